"""Full Blocks as files: path layout, the 64-byte header, atomic writes, verified zero-copy reads.

Layout: `<root>/<fingerprint hash>/<h[0:2]>/<h[2:4]>/<h>.blk` (hex), so two models never share a file
and no directory grows past ~4k entries per million blocks. Each file is a 64-byte header then the
payload (`block_file`). A read verifies magic, version, the header checksum, the fingerprint, the block hash,
the length and the payload checksum; any mismatch (torn, truncated, foreign or bit-rotten file) is a miss
and the file is removed.

Writes go to a temporary file in the same directory, then `os.replace` (atomic on POSIX and on the
distributed file systems we target). `fsync_policy`: `none` relies on the page cache (a crash may leave a
torn file, which reads detect); `file` fsyncs the data before the rename, so a name never points at torn
data; `dir` also fsyncs the directory, so an acknowledged block survives a power loss.

Blocking calls only: the service runs them in I/O threads. Nothing here knows about the bus.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from services.storage.block_file import (
    HEADER_BYTES,
    BlockHeader,
    ReadOutcome,
    check,
    fsync_dir,
    read_block,
    writer_node,
    writev_full,
)
from shared.errors import StorageError, StorageFullError

__all__ = ["HEADER_BYTES", "BlockHeader", "BlockStore", "ReadOutcome", "StoredBlock"]

_SUFFIX = ".blk"
_TMP_MARK = ".tmp-"
_STALE_TMP_S = 600.0


@dataclass(slots=True, frozen=True)
class StoredBlock:
    """A block file found by `scan`."""

    fingerprint_hash: int
    block_hash: int
    file_bytes: int
    mtime_s: float


class BlockStore:
    """The files of one root. Thread-safe: every method may run concurrently in I/O threads."""

    def __init__(self, root: str | Path, *, node: int, fsync_policy: str = "file") -> None:
        self.root = Path(root)
        self._root_str = str(self.root)
        self.node = node
        self.fsync_policy = fsync_policy
        self._dirs_made: set[Path] = set()
        self._dirs_lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, fingerprint_hash: int, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.root / f"{fingerprint_hash:016x}" / name[:2] / name[2:4] / (name + _SUFFIX)

    def exists(self, fingerprint_hash: int, block_hash: int, payload_bytes: int) -> bool:
        try:
            return self.path_for(fingerprint_hash, block_hash).stat().st_size == HEADER_BYTES + payload_bytes
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------------------------------------ read

    def read_into(
        self, fingerprint_hash: int, block_hash: int, dest: memoryview, *, verify: bool = True
    ) -> ReadOutcome:
        """Read one block's payload straight into `dest` (preadv, no intermediate buffer); verify it.

        Three syscalls (open, preadv, close), as a raw read of the file: the read asks for one byte past
        the expected end instead of an fstat. The checksum is computed over `dest` in place. A corrupt or
        foreign file is removed before returning. `dest` holds garbage unless the outcome is OK.
        """
        return self.read_run_into(fingerprint_hash, [block_hash], dest, verify=verify)[0]

    def read_run_into(
        self, fingerprint_hash: int, block_hashes: list[int], dest: memoryview, *, verify: bool = True
    ) -> list[ReadOutcome]:
        """`read_into` for consecutive blocks into equal consecutive slices of `dest`, stopping after the
        first that is not OK (its outcome is the last one returned). One header buffer for the run."""
        dest = dest.cast("B") if dest.format != "B" else dest
        payload_bytes = len(dest) // len(block_hashes)
        head = bytearray(HEADER_BYTES)
        outcomes: list[ReadOutcome] = []
        for i, block_hash in enumerate(block_hashes):
            view = dest[i * payload_bytes : (i + 1) * payload_bytes]
            try:
                fd = os.open(self._path_str(fingerprint_hash, block_hash), os.O_RDONLY)
            except FileNotFoundError:
                outcomes.append(ReadOutcome.MISSING)
                break
            try:
                got, trailing, checksum = read_block(fd, head, view, verify=verify)
            finally:
                os.close(fd)
            outcome = check(head, got, trailing, fingerprint_hash, block_hash, payload_bytes, checksum)
            outcomes.append(outcome)
            if outcome is not ReadOutcome.OK:
                self.remove(fingerprint_hash, block_hash)
                break
        return outcomes

    def _path_str(self, fingerprint_hash: int, block_hash: int) -> str:
        """`path_for` as a string, without pathlib's per-part objects (the read path's hot line)."""
        name = f"{block_hash:016x}"
        return f"{self._root_str}/{fingerprint_hash:016x}/{name[:2]}/{name[2:4]}/{name}{_SUFFIX}"

    def touch(self, fingerprint_hash: int, block_hash: int) -> None:
        """Refresh the file's mtime: the recency other nodes see when they evict from a shared root."""
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path_for(fingerprint_hash, block_hash))

    # ----------------------------------------------------------------------------------------- write

    def write(self, fingerprint_hash: int, block_hash: int, parent_hash: int, payload: memoryview) -> int:
        """Persist one block atomically; return the file's size. Raises StorageError (full, I/O error)."""
        path = self.path_for(fingerprint_hash, block_hash)
        header = BlockHeader(
            self.node,
            fingerprint_hash,
            block_hash,
            parent_hash,
            len(payload),
            xxhash.xxh3_64_intdigest(payload),
        )
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")
        try:
            self._make_dir(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                writev_full(fd, [memoryview(header.pack()), payload])
                if self.fsync_policy != "none":
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.fsync_policy == "dir":
                fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(f"storage full: cannot write block {block_hash:016x}: {exc}") from exc
            raise StorageError(f"cannot write block {block_hash:016x}: {exc}") from exc
        return HEADER_BYTES + len(payload)

    def remove(self, fingerprint_hash: int, block_hash: int) -> bool:
        try:
            self.path_for(fingerprint_hash, block_hash).unlink()
            return True
        except FileNotFoundError:
            return False

    def mtime_s(self, fingerprint_hash: int, block_hash: int) -> float | None:
        try:
            return self.path_for(fingerprint_hash, block_hash).stat().st_mtime
        except FileNotFoundError:
            return None

    def _make_dir(self, directory: Path) -> None:
        if directory in self._dirs_made:
            return
        directory.mkdir(parents=True, exist_ok=True)
        with self._dirs_lock:
            self._dirs_made.add(directory)

    # ------------------------------------------------------------------------------------------ scan

    def scan(self, *, only_own: bool) -> Iterator[StoredBlock]:
        """Every block file under root (own files only with `only_own`, by the header's writer node).

        Temporary files older than a few minutes (left by a crash) are removed on the way.
        """
        now = time.time()
        for fp_dir in _subdirs(self.root):
            try:
                fp_hash = int(fp_dir.name, 16)
            except ValueError:
                continue
            for sub in _subdirs(fp_dir):
                for leaf in _subdirs(sub):
                    yield from self._scan_leaf(leaf, fp_hash, now, only_own)

    def _scan_leaf(self, leaf: Path, fp_hash: int, now: float, only_own: bool) -> Iterator[StoredBlock]:
        with os.scandir(leaf) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if _TMP_MARK in entry.name:
                    if now - st.st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                if not entry.name.endswith(_SUFFIX):
                    continue
                try:
                    block_hash = int(entry.name[: -len(_SUFFIX)], 16)
                except ValueError:
                    continue
                if only_own and writer_node(entry.path) != self.node:
                    continue
                yield StoredBlock(fp_hash, block_hash, st.st_size, st.st_mtime)


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except FileNotFoundError:
        return []

"""Full Blocks as files: path layout, the 64-byte header, atomic writes, verified zero-copy reads.

Layout: `<root>/<fingerprint hash>/<h[0:2]>/<h[2:4]>/<h>.blk` (hex), so two models never share a file
and no directory grows past ~4k entries per million blocks. A file is a 64-byte header then the payload:

    magic "KVPBLK01" | version u16 | header bytes u16 | writer node u32 | fingerprint hash u64 |
    block hash u64 | parent hash u64 | payload bytes u64 | payload xxh3_64 u64 | header xxh3_64 u64

all little-endian. A read verifies magic, version, the header checksum, the fingerprint, the block hash,
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
import enum
import errno
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from shared.errors import StorageError

MAGIC = b"KVPBLK01"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHIQQQQQQ")
HEADER_BYTES = _HEADER.size  # 64
_SUFFIX = ".blk"
_TMP_MARK = ".tmp-"
_STALE_TMP_S = 600.0
_READ_CHUNK_BYTES = 256 * 1024  # fits in L2: each chunk is hashed while still cached


class ReadOutcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"
    FOREIGN = "foreign"


@dataclass(slots=True, frozen=True)
class BlockHeader:
    writer_node: int
    fingerprint_hash: int
    block_hash: int
    parent_hash: int
    payload_bytes: int
    payload_checksum: int

    def pack(self) -> bytes:
        fields = (
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            self.writer_node,
            self.fingerprint_hash,
            self.block_hash,
            self.parent_hash,
            self.payload_bytes,
            self.payload_checksum,
        )
        head_sum = xxhash.xxh3_64_intdigest(_HEADER.pack(*fields, 0)[: HEADER_BYTES - 8])
        return _HEADER.pack(*fields, head_sum)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> BlockHeader | None:
        """The header, or None when it is not a valid kvpath block header."""
        if len(raw) < HEADER_BYTES:
            return None
        fields = _HEADER.unpack_from(raw)
        magic, version, header_bytes, node, fp, block, parent, length, checksum, head_sum = fields
        if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
            return None
        if xxhash.xxh3_64_intdigest(bytes(raw[: HEADER_BYTES - 8])) != head_sum:
            return None
        return cls(node, fp, block, parent, length, checksum)


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

        The payload is read in chunks and each chunk is hashed right after it lands, while it is still in
        the CPU cache, so verifying costs no second pass over memory. A corrupt or foreign file is removed
        before returning. `dest` holds garbage unless the outcome is OK.
        """
        path = self.path_for(fingerprint_hash, block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return ReadOutcome.MISSING
        hasher = xxhash.xxh3_64() if verify else None
        try:
            head = bytearray(HEADER_BYTES)
            got = _read_hashed(fd, head, dest, hasher)
            trailing = os.fstat(fd).st_size - (HEADER_BYTES + len(dest))
        finally:
            os.close(fd)
        checksum = hasher.intdigest() if hasher is not None else None
        outcome = self._check(head, got, trailing, fingerprint_hash, block_hash, len(dest), checksum)
        if outcome is not ReadOutcome.OK:
            self.remove(fingerprint_hash, block_hash)
        return outcome

    @staticmethod
    def _check(
        head: bytearray,
        got: int,
        trailing: int,
        fingerprint_hash: int,
        block_hash: int,
        payload_bytes: int,
        checksum: int | None,
    ) -> ReadOutcome:
        header = BlockHeader.unpack(head) if got >= HEADER_BYTES else None
        if header is None:
            return ReadOutcome.CORRUPT
        if header.fingerprint_hash != fingerprint_hash:
            return ReadOutcome.FOREIGN
        if header.block_hash != block_hash or header.payload_bytes != payload_bytes:
            return ReadOutcome.CORRUPT
        if got != HEADER_BYTES + payload_bytes or trailing != 0:
            return ReadOutcome.CORRUPT
        if checksum is not None and checksum != header.payload_checksum:
            return ReadOutcome.CORRUPT
        return ReadOutcome.OK

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
                _writev_full(fd, [memoryview(header.pack()), payload])
                if self.fsync_policy != "none":
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.fsync_policy == "dir":
                _fsync_dir(path.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(f"storage full: cannot write block {block_hash:016x}: {exc}") from exc
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
                if only_own and _writer_node(entry.path) != self.node:
                    continue
                yield StoredBlock(fp_hash, block_hash, st.st_size, st.st_mtime)


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except FileNotFoundError:
        return []


def _writer_node(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            header = BlockHeader.unpack(f.read(HEADER_BYTES))
    except OSError:
        return None
    return None if header is None else header.writer_node


def _read_hashed(fd: int, head: bytearray, dest: memoryview, hasher: Any) -> int:
    """Read header + payload into (head, dest) in cache-sized chunks, hashing each chunk as it lands.

    Returns the bytes read (less than header + payload at end of file).
    """
    dest = dest.cast("B") if dest.format != "B" else dest
    first = min(_READ_CHUNK_BYTES, len(dest))
    got = _preadv_full(fd, [memoryview(head), dest[:first]], 0)
    if got < HEADER_BYTES + first:
        return got
    if hasher is not None:
        hasher.update(dest[:first])
    offset = first
    while offset < len(dest):
        end = min(offset + _READ_CHUNK_BYTES, len(dest))
        n = _preadv_full(fd, [dest[offset:end]], HEADER_BYTES + offset)
        got += n
        if n < end - offset:
            return got
        if hasher is not None:
            hasher.update(dest[offset:end])
        offset = end
    return got


def _preadv_full(fd: int, views: list[memoryview], file_offset: int) -> int:
    """preadv into `views` from `file_offset` until they are full or the file ends; return bytes read."""
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        n = os.preadv(fd, _skip(views, done), file_offset + done)
        if n == 0:
            break
        done += n
    return done


def _writev_full(fd: int, buffers: list[memoryview]) -> None:
    views = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        done += os.writev(fd, _skip(views, done))


def _skip(views: list[memoryview], offset: int) -> list[memoryview]:
    """The iovec list past the first `offset` bytes."""
    out = []
    for v in views:
        if offset >= v.nbytes:
            offset -= v.nbytes
            continue
        out.append(v[offset:] if offset else v)
        offset = 0
    return out


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

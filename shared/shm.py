"""Named shared-memory segments that several processes map: node DRAM buffers, shm transport regions.

A segment is a file under /dev/shm (a tmpfs) mapped with mmap, so it has a name other processes can map
and no resource tracker unlinks it behind the owner's back (multiprocessing.shared_memory does). The
creator owns the name and unlinks it; attachers only map and unmap.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from pathlib import Path

import numpy as np

from shared.protocol.subjects import check_token

_SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def segment_path(name: str) -> Path:
    return _SHM_DIR / check_token(name, "shared-memory segment name")


class ShmSegment:
    """One mapped segment. `buf` is a writable memoryview over all of it."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        self.name = name
        self.path = segment_path(name)
        self.is_owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            raise
        os.close(fd)
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, name: str, size: int, *, replace: bool = False) -> ShmSegment:
        """Create a new segment; `replace` removes a stale one left by a crashed owner first."""
        if size <= 0:
            raise ValueError(f"segment size must be > 0, got {size}")
        if replace:
            with contextlib.suppress(FileNotFoundError):
                segment_path(name).unlink()
        return cls(name, size, create=True)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        return cls(name, 0, create=False)

    def array(self, dtype: np.dtype | type = np.uint8, offset: int = 0, count: int = -1) -> np.ndarray:
        """A zero-copy numpy view of part of the segment."""
        return np.frombuffer(self._mmap, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        """Unmap (and unlink, for the owner). Views handed out must be dropped first."""
        if self._mmap.closed:
            return
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            # a numpy view is still alive somewhere; the mapping goes when it does
            pass
        if self.is_owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix` (e.g. a stopped cluster's namespace), so
    segments of processes that were killed do not outlive them. Returns how many were removed."""
    check_token(prefix.rstrip("-") or "x", "segment prefix")
    removed = 0
    for path in _SHM_DIR.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed

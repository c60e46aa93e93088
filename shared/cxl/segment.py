"""The mapped file of one CXL-RPC endpoint, with the descriptor that carries its liveness locks.

`shared.shm.ShmSegment` closes its file descriptor once mapped; this transport keeps it, because liveness is
an OFD lock on a byte of the same file (F_OFD_SETLK: owned by the open file description, so two clients in
one process still exclude each other, and released by the kernel when the process dies, however it dies).
The server holds byte 0 while it serves, client c byte 1 + c while it holds entry c. Locks are advisory and
lie outside the data path: reads and writes go through the mapping.

A server always creates a fresh file: a restarted server never sees requests or half-written replies meant
for its predecessor, and clients of the old file find its lock gone. The name is refused while a live server
holds the existing file's lock; a file left by a dead server is unlinked first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import struct
from pathlib import Path

from shared.cxl.layout import SERVER_LOCK_BYTE
from shared.errors import ServiceUnavailableError
from shared.shm import segment_path

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on x86-64: type, whence, start, len, pid


class RpcSegment:
    """One mapping of a segment file: `mm` (the mmap itself: slice assignment copies without views) and
    `u64`/`u32`, the same bytes as words (index = byte offset // 8 or // 4) for the fields that other
    processes read while they change (see layout.py: one store each, never torn)."""

    def __init__(self, path: Path, fd: int, *, is_owner: bool) -> None:
        self.path = path
        self.is_owner = is_owner
        self._fd = fd
        self.size_bytes = os.fstat(fd).st_size
        self.inode = os.fstat(fd).st_ino
        self.mm = mmap.mmap(fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        whole_words = memoryview(self.mm)[: self.size_bytes - self.size_bytes % 8]
        self.u64 = whole_words.cast("Q")
        self.u32 = whole_words.cast("I")
        whole_words.release()
        anchor = ctypes.c_char.from_buffer(self.mm)
        self.base_address = ctypes.addressof(anchor)  # for futexes; valid while `mm` is open
        del anchor  # holds an export of the mmap, which would keep close() from unmapping

    @classmethod
    def create(cls, name: str, size_bytes: int) -> RpcSegment:
        """A new zero-filled segment under `name`, its server lock taken."""
        path = segment_path(name)
        _unlink_if_abandoned(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            segment = cls(path, fd, is_owner=True)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        if not segment.try_lock(SERVER_LOCK_BYTE):  # another server replaced our file: refuse to share
            segment.close()
            raise ServiceUnavailableError(f"CXL-RPC segment {name} was taken over while being created")
        return segment

    @classmethod
    def attach(cls, name: str) -> RpcSegment:
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ServiceUnavailableError(f"no CXL-RPC server: segment {name} does not exist") from None
        try:
            return cls(path, fd, is_owner=False)
        except BaseException:
            os.close(fd)
            raise

    def try_lock(self, byte: int) -> bool:
        """Take the exclusive lock on one byte of the file; False when another description holds it."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def unlock(self, byte: int) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))

    def is_locked_by_other(self, byte: int) -> bool:
        """Whether another open description (a live process) holds the lock on `byte`."""
        return _is_locked(self._fd, byte)

    def is_current(self) -> bool:
        """Whether the name still refers to this file (a restarted server replaces it)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Unmap, drop the locks (closing the descriptor does) and, for the owner, unlink the name."""
        if self._fd < 0:
            return
        if self.is_owner and self.is_current():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.u64.release()
        self.u32.release()
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes when it does
            self.mm.close()
        os.close(self._fd)
        self._fd = -1


def _unlink_if_abandoned(path: Path) -> None:
    """Remove a file left by a dead server; refuse the name while a live one holds it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        is_served = _is_locked(fd, SERVER_LOCK_BYTE)
    finally:
        os.close(fd)
    if is_served:
        raise ServiceUnavailableError(f"a live CXL-RPC server already serves {path.name}")
    path.unlink(missing_ok=True)


def _is_locked(fd: int, byte: int) -> bool:
    probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
    lock_type = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0]
    return bool(lock_type != fcntl.F_UNLCK)

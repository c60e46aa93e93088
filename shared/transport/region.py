"""Registered receive regions: memory a `KvReceiver` owns and senders write into.

A region's memory is a shared-memory segment when the receiver offers `shm` (same-host senders map it)
and an anonymous mapping otherwise. The receiver creates and frees regions; callers get zero-copy numpy
views and must drop them before `KvReceiver.unregister_region` (a view still alive keeps the mapping
alive, never dangling).
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

from shared.errors import TransportError
from shared.shm import ShmSegment

MAX_REGION_NAME = 200


def check_region_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_REGION_NAME:
        raise TransportError(
            f"region name must be 1..{MAX_REGION_NAME} characters, got {name!r}", param="region"
        )
    return name


class Region:
    """One registered region. `view(offset, length)` is a writable uint8 view of its bytes."""

    __slots__ = ("_closed", "_mmap", "_segment", "_whole", "name", "rdma_key", "region_id", "size_bytes")

    def __init__(self, name: str, region_id: int, size_bytes: int, *, shm_name: str | None) -> None:
        if size_bytes <= 0:
            raise TransportError(f"region {name!r}: size must be > 0 bytes, got {size_bytes}", param="size")
        self.name = check_region_name(name)
        self.region_id = region_id
        self.size_bytes = size_bytes
        self.rdma_key: object | None = None  # the MR while registered with an RDMA device (rdma.py)
        self._segment = ShmSegment.create(shm_name, size_bytes, replace=True) if shm_name else None
        self._mmap = None if self._segment else mmap.mmap(-1, size_bytes)
        self._closed = False
        self._whole: memoryview | None = None  # cached byte view of everything (sockets receive into it)

    @property
    def shm_segment(self) -> str:
        """Name of the shared-memory segment backing the region, '' when it is private memory."""
        return self._segment.name if self._segment else ""

    @property
    def is_open(self) -> bool:
        return not self._closed

    def array(self) -> np.ndarray:
        """The whole region as a uint8 array (a view)."""
        if self._segment is not None:
            return self._segment.array()
        assert self._mmap is not None
        return np.frombuffer(self._mmap, dtype=np.uint8)

    def view(self, offset: int, length: int) -> np.ndarray:
        """Bytes [offset, offset+length) as a writable uint8 view; TransportError when out of bounds."""
        self.check_extent(offset, length)
        return self.array()[offset : offset + length]

    def buffer(self, offset: int, length: int) -> memoryview:
        """Like view(), as a memoryview (what sockets receive into)."""
        self.check_extent(offset, length)
        if self._whole is None:
            self._whole = self.array().data
        return self._whole[offset : offset + length]

    def address(self) -> int:
        """Virtual address of byte 0 in this process (for RDMA memory registration)."""
        return int(self.array().ctypes.data)

    def check_extent(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise TransportError(
                f"region {self.name!r}: extent [{offset}, {offset + length}) is outside its "
                f"{self.size_bytes} bytes",
                param="offset",
            )

    def close(self) -> None:
        """Free the memory (unlink the segment). Views still alive keep their mapping until dropped."""
        self._closed = True
        if self._whole is not None:
            self._whole.release()
            self._whole = None
        if self._segment is not None:
            self._segment.close()
        elif self._mmap is not None and not self._mmap.closed:
            with contextlib.suppress(BufferError):
                self._mmap.close()

    def __repr__(self) -> str:
        kind = "shm" if self._segment else "private"
        return f"Region({self.name!r}, id={self.region_id}, {self.size_bytes} bytes, {kind})"

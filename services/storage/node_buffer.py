"""Space in the node DRAM buffer: contiguous extents for reads, FIFO waiting, leases, deferred frees.

One read gets one extent (so the engine sees a single `[n, L, bs, bytes]` view). When the buffer is full a
read waits, oldest first, for space that releases and expired leases give back. An extent that I/O
threads may still be writing into (a cancelled read) is freed only once those threads are done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any

from services.storage import metrics
from services.storage.leases import Lease, LeaseTable
from shared.blocks import ExtentAllocator


class NodeBuffer:
    def __init__(self, capacity_bytes: int) -> None:
        self.allocator = ExtentAllocator(capacity_bytes)
        self.leases = LeaseTable()
        self._waiters: deque[tuple[int, asyncio.Future[int]]] = deque()

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def usable_bytes(self) -> int:
        """The largest extent this buffer can ever hold."""
        return self.allocator.capacity_bytes - self.allocator.capacity_bytes % self.allocator.alignment

    async def allocate(self, nbytes: int) -> int:
        """Offset of an extent of `nbytes`, waiting in FIFO order for space (cancellable)."""
        if not self._waiters:
            offset = self.allocator.allocate(nbytes)
            if offset is not None:
                self._changed()
                return offset
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        entry = (nbytes, future)
        self._waiters.append(entry)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted just as we were cancelled
                self.free(future.result())
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    def shrink(self, offset: int, nbytes: int) -> None:
        self.allocator.shrink(offset, nbytes)
        self._grant()

    def free(self, offset: int) -> None:
        self.allocator.free(offset)
        self._grant()

    def free_when_idle(self, offset: int, ios: Sequence[concurrent.futures.Future[Any]]) -> None:
        """Free an extent once no I/O thread writes into it any more."""
        busy = [io for io in ios if not io.done()]
        if not busy:
            self.free(offset)
            return
        loop = asyncio.get_running_loop()
        left = [len(busy)]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                self.free(offset)

        for io in busy:
            io.add_done_callback(lambda _f: loop.call_soon_threadsafe(one_done))

    def _grant(self) -> None:
        """Hand freed space to waiting reads, oldest first (no overtaking)."""
        while self._waiters:
            nbytes, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
                continue
            offset = self.allocator.allocate(nbytes)
            if offset is None:
                break
            self._waiters.popleft()
            future.set_result(offset)
        self._changed()

    def _changed(self) -> None:
        metrics.BUFFER_USED_BYTES.set(self.allocator.used_bytes)
        metrics.BUFFER_LEASED_BYTES.set(self.leases.leased_bytes)

    # ------------------------------------------------------------------------------------------ leases

    def lease(self, lease: Lease) -> None:
        self.leases.add(lease)
        self._changed()

    def release(self, lease_id: str) -> bool:
        lease = self.leases.pop(lease_id)
        if lease is not None:
            self.free(lease.offset)
        return lease is not None

    def release_request(self, request_id: str) -> int:
        leases = self.leases.pop_request(request_id)
        for lease in leases:
            self.free(lease.offset)
        return len(leases)

    def reap_expired(self, now_s: float) -> int:
        expired = self.leases.pop_expired(now_s)
        for lease in expired:
            self.free(lease.offset)
        metrics.LEASES_EXPIRED.inc(len(expired))
        return len(expired)

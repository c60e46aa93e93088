"""A registered data-plane region carved into extents with one notice slot each: what the two sides of a
move-the-query session write into (the holder's query region, `holder_server.py`; the requester's reply
region, `route_session.py`), and how each names the other's extent on the wire (`RouteBuffer`).

Ownership: whoever reserved an extent releases it; a notice slot is reused only after its extent is released.
"""

from __future__ import annotations

from shared.blocks import ExtentAllocator
from shared.errors import OverloadedError
from shared.protocol.movequery import RouteBuffer
from shared.protocol.tasks import BufferRef
from shared.transport import KvReceiver, Region


class RouteRegion:
    def __init__(
        self, receiver: KvReceiver, name: str, size_bytes: int, *, engine_id: str, label: str
    ) -> None:
        self.receiver = receiver
        self.name = name
        self.engine_id = engine_id
        self.label = label  # what a refusal calls the region
        self.region: Region = receiver.register_region(name, size_bytes)
        self._alloc = ExtentAllocator(size_bytes)
        self._next_slot = 1

    def reserve(self, nbytes: int) -> tuple[int, int]:
        """(offset, notice slot) of an extent of `nbytes`; OverloadedError when the region is full."""
        offset = self._alloc.allocate(nbytes)
        if offset is None:
            raise OverloadedError(f"{self.label} full ({self._alloc.free_bytes} bytes free)")
        slot, self._next_slot = self._next_slot, self._next_slot % ((1 << 31) - 1) + 1
        return offset, slot

    def release(self, offset: int, slot: int) -> None:
        self.receiver.discard(self.name, [slot])
        self._alloc.free(offset)

    def buffer(self, offset: int, size_bytes: int, slot: int) -> RouteBuffer:
        """The extent as a peer names it: it writes into it and notices `slot`."""
        return RouteBuffer(
            engine_id=self.engine_id,
            endpoint=self.receiver.endpoint(),
            region=self.name,
            offset=offset,
            size_bytes=size_bytes,
            slot=slot,
        )


def peer_ref(buffer: RouteBuffer) -> BufferRef:
    """The data-plane address of a peer's route extent (what `PeerPool.get` connects to)."""
    return BufferRef(
        engine_id=buffer.engine_id,
        endpoint=buffer.endpoint,
        region=buffer.region,
        offset=buffer.offset,
        slot=buffer.slot,
        num_blocks=0,
    )

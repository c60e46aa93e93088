"""A registered transport region carved into per-request extents of Full Blocks, which peers write into
(one-sided): the DE buffer, and the PE's receive area for DE-path hits.

Every extent has a notice slot and an expiry; the request that reserved it holds it (in its connector
record) and frees it, and an extent past its expiry is reaped, so a request that is never completed (peer
died, aborted mid-transfer) cannot leak buffer space. Notices of an extent use tags
`slot * TAGS_PER_SLOT + layer`; DONE is a reserved "layer".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from shared.blocks import BlockLayout, ExtentAllocator, full_blocks_view
from shared.errors import KvpathError, OverloadedError
from shared.protocol.tasks import BufferRef
from shared.transport import KvReceiver, Region

log = logging.getLogger(__name__)

TAGS_PER_SLOT = 256
DONE_LAYER = 255  # PE -> DE: the prompt's KV is complete (meta: an encoded PrefillDone)
DRAIN_GRACE_S = 30.0  # an abandoned extent waits this long past its request's deadline for its writer at most
_MAX_SLOT = (1 << 32) // TAGS_PER_SLOT


def tag(slot: int, layer: int) -> int:
    return slot * TAGS_PER_SLOT + layer


@dataclass(slots=True, eq=False)
class Extent:
    request_id: str
    offset: int
    slot: int
    num_blocks: int
    expires_at: float  # monotonic


class ReceiveArea:
    """Extents of a region that peers write into (one-sided), with notice slots."""

    def __init__(
        self, receiver: KvReceiver, name: str, size_bytes: int, layout: BlockLayout, engine_id: str
    ) -> None:
        self.receiver = receiver
        self.name = name
        self.layout = layout
        self.engine_id = engine_id
        self.region: Region = receiver.register_region(name, size_bytes)
        self._alloc = ExtentAllocator(size_bytes)
        self._extents: set[Extent] = set()  # reserved and not freed, for the reaper
        self._next_slot = 1

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_bytes

    def reserve(self, request_id: str, num_blocks: int, ttl_s: float) -> Extent:
        """An extent for `num_blocks` Full Blocks; OverloadedError when the area is full."""
        self.reap()
        offset = self._alloc.allocate(self.layout.blocks_bytes(max(1, num_blocks)))
        if offset is None:
            raise OverloadedError(
                f"{self.name} full: {num_blocks} blocks wanted, {self._alloc.free_bytes} bytes free"
            )
        slot = self._next_slot
        self._next_slot = self._next_slot % (_MAX_SLOT - 1) + 1
        extent = Extent(request_id, offset, slot, num_blocks, time.monotonic() + ttl_s)
        self._extents.add(extent)
        return extent

    def ref(self, extent: Extent) -> BufferRef:
        """How the extent's writer names it (this engine's data-plane endpoint)."""
        return BufferRef(
            engine_id=self.engine_id,
            endpoint=self.receiver.endpoint(),
            region=self.name,
            offset=extent.offset,
            slot=extent.slot,
            num_blocks=extent.num_blocks,
        )

    def blocks(self, extent: Extent, first: int = 0, count: int | None = None) -> np.ndarray:
        """Zero-copy view of Full Blocks [first, first + count) of the extent: uint8 [n, L, bs, bytes]."""
        n = extent.num_blocks - first if count is None else count
        offset = extent.offset + first * self.layout.full_block_bytes
        return full_blocks_view(self.region.array(), offset, n, self.layout)

    async def wait(self, extent: Extent, layer: int, *, timeout_s: float, peer_id: str | None) -> bytes:
        notice = await self.receiver.wait(
            self.name, tag(extent.slot, layer), timeout_s=timeout_s, peer_id=peer_id
        )
        return notice.meta

    async def drain(self, extent: Extent, layer: int, *, peer_id: str) -> None:
        """Free the extent once its writer's notice of `layer` (its last) is in, or the writer is gone, at the
        latest at the extent's expiry (an extent still being written into must not be reused)."""
        timeout = max(0.01, extent.expires_at - time.monotonic())
        try:
            await self.wait(extent, layer, timeout_s=timeout, peer_id=peer_id)
        except KvpathError:
            pass  # the writer died or never answered: nothing writes into the extent any more
        self.free(extent)

    def free(self, extent: Extent) -> None:
        """Give the extent back (idempotent: the reaper may have freed it already)."""
        if extent in self._extents:
            self._extents.discard(extent)
            self.receiver.discard(self.name, [tag(extent.slot, layer) for layer in range(TAGS_PER_SLOT)])
            self._alloc.free(extent.offset)

    def reap(self) -> int:
        """Free extents past their expiry (their writer died or never finished)."""
        now = time.monotonic()
        expired = [e for e in self._extents if e.expires_at < now]
        for extent in expired:
            rid = extent.request_id
            log.warning(
                "reaping expired extent area=%s request_id=%s", self.name, rid, extra={"request_id": rid}
            )
            self.free(extent)
        return len(expired)

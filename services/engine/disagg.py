"""Pieces shared by the prefill and decode sides of disaggregated serving.

- `ReceiveArea`: a registered transport region carved into per-request extents of Full Blocks (the DE buffer;
  the PE's receive area for DE-path hits). Every extent has an owner request, a notice slot and an expiry, so
  a request that is never completed (peer died, aborted mid-transfer) cannot leak buffer space.
- Tags: notices of an extent use `slot * TAGS_PER_SLOT + layer`; DONE and END are reserved "layers".
- `PeerPool`: one transport Peer per remote engine, reconnected when broken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from shared.blocks import BlockLayout, ExtentAllocator, full_blocks_view
from shared.errors import KvpathError, OverloadedError, TransportError
from shared.protocol.disagg import BufferRef
from shared.transport import KvReceiver, KvSender, Peer, Region

log = logging.getLogger(__name__)

TAGS_PER_SLOT = 256
DONE_LAYER = 255  # PE -> DE: the prompt's KV is complete (meta: first token, finish, timings)
END_LAYER = 254  # DE -> PE: the hit stream stopped early (meta: reason)
_MAX_SLOT = (1 << 32) // TAGS_PER_SLOT


def tag(slot: int, layer: int) -> int:
    return slot * TAGS_PER_SLOT + layer


@dataclass(slots=True)
class Extent:
    request_id: str
    offset: int
    slot: int
    num_blocks: int
    expires_at: float  # monotonic


class ReceiveArea:
    """Per-request extents of a region that peers write into (one-sided), with notice slots."""

    def __init__(
        self, receiver: KvReceiver, name: str, size_bytes: int, layout: BlockLayout, engine_id: str
    ) -> None:
        self.receiver = receiver
        self.name = name
        self.layout = layout
        self.engine_id = engine_id
        self.region: Region = receiver.register_region(name, size_bytes)
        self._alloc = ExtentAllocator(size_bytes)
        self._extents: dict[str, Extent] = {}
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
        self._extents[request_id] = extent
        return extent

    def get(self, request_id: str) -> Extent | None:
        return self._extents.get(request_id)

    def ref(self, extent: Extent, endpoint: dict[str, Any]) -> BufferRef:
        return BufferRef(
            engine_id=self.engine_id,
            endpoint=endpoint,
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

    def free(self, request_id: str) -> None:
        extent = self._extents.pop(request_id, None)
        if extent is not None:
            self.receiver.discard(self.name, [tag(extent.slot, layer) for layer in range(TAGS_PER_SLOT)])
            self._alloc.free(extent.offset)

    def reap(self) -> int:
        """Free extents past their expiry (their writer died or never finished)."""
        now = time.monotonic()
        expired = [rid for rid, e in self._extents.items() if e.expires_at < now]
        for rid in expired:
            log.warning(
                "reaping expired extent area=%s request_id=%s", self.name, rid, extra={"request_id": rid}
            )
            self.free(rid)
        return len(expired)


def encode_meta(**fields: Any) -> bytes:
    return orjson.dumps(fields)


def decode_meta(meta: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(meta) if meta else {}
    except orjson.JSONDecodeError:
        return {"error": "malformed notice metadata"}
    return obj if isinstance(obj, dict) else {"error": "malformed notice metadata"}


class PeerPool:
    """One transport Peer per remote engine; a broken one is replaced on next use."""

    def __init__(self, sender: KvSender) -> None:
        self.sender = sender
        self._peers: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, ref: BufferRef, *, timeout_s: float) -> Peer:
        peer = self._peers.get(ref.engine_id)
        if peer is not None and peer.is_open:
            return peer
        async with self._locks.setdefault(ref.engine_id, asyncio.Lock()):
            peer = self._peers.get(ref.engine_id)
            if peer is not None and peer.is_open:
                return peer
            try:
                peer = await self.sender.connect(ref.endpoint, timeout_s=timeout_s)
            except KvpathError:
                raise
            except OSError as exc:
                raise TransportError(f"cannot reach engine {ref.engine_id}: {exc}") from exc
            self._peers[ref.engine_id] = peer
            return peer

    async def close(self) -> None:
        for peer in self._peers.values():
            try:
                await peer.close()
            except Exception as exc:
                log.debug("peer close failed: %r", exc)
        self._peers.clear()

"""The remote tier's local super-block cache as the index sees it: location `dram:<engine_id>`.

BlockStored names every block of a super block that became READY in the cache (fetched or written), and
BlockRemoved those of one evicted from it, on the engine's own event source; the index's `per_location`
count for `dram:<engine_id>` is then how many leading blocks of a prompt this engine holds locally, which is
what a cache-aware router weighs against load. On start and on close the location is Cleared (a restarted
engine of the same id holds nothing). Events that cannot be published are counted and dropped: they only
steer routing, never correctness (a stale entry is a local miss that the store or a recompute covers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from services.engine import metrics
from services.engine.remote_cache import CacheEntry
from shared.bus import Bus
from shared.errors import KvpathError
from shared.kvclient import IndexClient, KvEventPublisher

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 1.0  # an engine stopping does not wait longer to say its cache is gone
INDEX_WAIT_S = 2.0  # longest a write waits for the index to apply its BlockStored (as persisting does)


class CacheAnnouncer:
    def __init__(self, bus: Bus, engine_id: str, *, block_tokens: int) -> None:
        self.location = f"dram:{engine_id}"
        self.events = KvEventPublisher(bus, f"dram-{engine_id}")
        self.index = IndexClient(bus)
        self.block_tokens = block_tokens

    async def start(self) -> None:
        try:
            await self.events.start()
            await self.events.cleared([self.location], reason="restarted")
        except KvpathError as exc:
            metrics.REMOTE_ERRORS.labels("event", exc.code).inc()
            log.warning("KV events unavailable for %s: %s", self.location, exc.message)

    async def stored(self, entries: Sequence[CacheEntry], *, wait_applied: bool = False) -> None:
        """Announce the super blocks' blocks at this engine; with `wait_applied`, until the index has them
        (bounded), so the request's next turn is routed by them."""
        hashes = [h for e in entries for h in e.block_hashes]
        parents = [p for e in entries for p in (e.parent_hash, *e.block_hashes[:-1])]
        try:
            seq = await self.events.stored(self.location, hashes, parents, block_tokens=self.block_tokens)
            if wait_applied:
                await self.index.wait_applied(seq, timeout_s=INDEX_WAIT_S)
        except KvpathError as exc:
            metrics.REMOTE_ERRORS.labels("event", exc.code).inc()
            log.warning("BlockStored for %s not applied: %s", self.location, exc.message)

    async def removed(self, entries: Sequence[CacheEntry]) -> None:
        hashes = [h for e in entries for h in e.block_hashes]
        try:
            await self.events.removed(self.location, hashes, reason="evicted")
        except KvpathError as exc:
            metrics.REMOTE_ERRORS.labels("event", exc.code).inc()
            log.warning("BlockRemoved for %s not published: %s", self.location, exc.message)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.events.cleared([self.location], reason="released"), CLOSE_WAIT_S)
        except (KvpathError, TimeoutError) as exc:
            log.debug("Cleared for %s not published: %r", self.location, exc)

"""The remote tier's local super-block cache as the index sees it: location `dram:<engine_id>`.

BlockStored names every block of a super block that became READY in the cache (fetched or written), and
BlockRemoved those of one evicted from it, on the engine's own event source; the index's `per_location`
count for `dram:<engine_id>` is then how many leading blocks of a prompt this engine holds locally, which is
what a cache-aware router weighs against load. On start and on close the location is Cleared (a restarted
engine of the same id holds nothing; `location_events.py`, shared with sessions' `hbm:` location).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine import metrics
from services.engine.location_events import LocationAnnouncer
from services.engine.remote_cache import CacheEntry
from shared.bus import Bus
from shared.errors import KvpathError


class CacheAnnouncer(LocationAnnouncer):
    def __init__(self, bus: Bus, engine_id: str, *, block_tokens: int) -> None:
        super().__init__(bus, "dram", engine_id, block_tokens=block_tokens)

    def count_error(self, exc: KvpathError) -> None:
        metrics.REMOTE_ERRORS.labels("event", exc.code).inc()

    async def stored(self, entries: Sequence[CacheEntry], *, wait_applied: bool = False) -> None:
        """Announce the super blocks' blocks at this engine; with `wait_applied`, until the index has them
        (bounded), so the request's next turn is routed by them."""
        hashes = [h for e in entries for h in e.block_hashes]
        parents = [p for e in entries for p in (e.parent_hash, *e.block_hashes[:-1])]
        await self.publish((), hashes, parents, reason="", wait_applied=wait_applied)

    async def removed(self, entries: Sequence[CacheEntry]) -> None:
        hashes = [h for e in entries for h in e.block_hashes]
        await self.publish(hashes, (), (), reason="evicted", wait_applied=False)

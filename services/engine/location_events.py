"""KV events of one engine-local location, `<kind>:<engine id>`, on the engine's own event source.

Two locations use it: `hbm:` (sessions' KV resident in the paged cache, `sessions.py`) and `dram:` (the
remote tier's local super-block cache, `remote_events.py`). The location is Cleared on start and on close
(a restarted engine of the same id holds nothing). Events that cannot be published are counted (by the
subclass: each location has its metric) and dropped: they steer routing, never correctness (a stale entry is
a local miss that the store or a recompute covers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from shared.bus import Bus
from shared.errors import KvpathError
from shared.kvclient import IndexClient, KvEventPublisher

log = logging.getLogger(__name__)

INDEX_WAIT_S = 2.0  # longest an announcement waits for the index to apply it (as persisting does)
CLOSE_WAIT_S = 1.0  # an engine stopping does not wait longer to say the location is gone


class LocationAnnouncer:
    def __init__(self, bus: Bus, kind: str, engine_id: str, *, block_tokens: int) -> None:
        self.location = f"{kind}:{engine_id}"
        self.events = KvEventPublisher(bus, f"{kind}-{engine_id}")
        self.index = IndexClient(bus)
        self.block_tokens = block_tokens

    def count_error(self, exc: KvpathError) -> None:
        """Count an event that could not be published (the location's metric)."""

    async def start(self) -> None:
        try:
            await self.events.start()
            await self.events.cleared([self.location], reason="restarted")
        except KvpathError as exc:
            self.count_error(exc)
            log.warning("KV events unavailable for %s: %s", self.location, exc.message)

    async def publish(
        self,
        removed: Sequence[int],
        stored: Sequence[int],
        parents: Sequence[int],
        *,
        reason: str,
        wait_applied: bool,
    ) -> None:
        """BlockRemoved for `removed` (with `reason`), then BlockStored for `stored`; with `wait_applied`,
        until the index has applied them (bounded), so the request's next turn is routed by them."""
        try:
            seq = 0
            if removed:
                seq = await self.events.removed(self.location, removed, reason=reason)
            if stored:
                seq = await self.events.stored(self.location, stored, parents, block_tokens=self.block_tokens)
            if seq and wait_applied:
                await self.index.wait_applied(seq, timeout_s=INDEX_WAIT_S)
        except KvpathError as exc:
            self.count_error(exc)
            log.warning("KV events of %s not announced: %s", self.location, exc.message)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.events.cleared([self.location], reason="released"), CLOSE_WAIT_S)
        except (KvpathError, TimeoutError) as exc:
            log.debug("Cleared for %s not published: %r", self.location, exc)

"""The metadata index as the router and engines use it: longest stored prefix, stats, applied events."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.bus import Bus
from shared.errors import (
    DeadlineExceededError,
    ServiceUnavailableError,
)
from shared.protocol.kv import (
    IndexMatchReply,
    IndexMatchRequest,
    IndexStats,
    IndexStatsRequest,
)

_CONTROL_TIMEOUT_S = 2.0


@dataclass(slots=True, frozen=True)
class MatchResult:
    num_hit_blocks: int  # consecutive from the start, present in any location (only `store` for now)
    per_tier: dict[str, int] = field(default_factory=dict)
    per_location: dict[str, int] = field(default_factory=dict)


class IndexClient:
    """The router's and engines' view of the metadata index."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def match(self, block_hashes: Sequence[int], *, timeout_s: float | None = None) -> MatchResult:
        """Longest prefix present per tier. Index down: ServiceUnavailableError / DeadlineExceededError."""
        if not block_hashes:
            return MatchResult(0)
        reply = await self.bus.request(
            self.bus.subjects.index_match,
            IndexMatchRequest(block_hashes=list(block_hashes)),  # plain ints: `shared.hashing.block_hashes`
            IndexMatchReply,
            timeout_s=timeout_s,
        )
        return MatchResult(reply.num_hit_blocks, reply.per_tier, reply.per_location)

    async def stats(self, *, timeout_s: float | None = None) -> IndexStats:
        return await self.bus.request(
            self.bus.subjects.index_stats, IndexStatsRequest(), IndexStats, timeout_s=timeout_s
        )

    async def wait_applied(self, stream_seq: int, *, timeout_s: float, fail_fast: bool = False) -> IndexStats:
        """Wait until the index has applied the KV event at `stream_seq` (e.g. a write's event).
        `fail_fast`: no index answering at all is a ServiceUnavailableError at once (not polled)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay_s = 0.005
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"index did not apply stream seq {stream_seq} within {timeout_s}s"
                )
            try:
                stats = await self.stats(timeout_s=min(remaining, _CONTROL_TIMEOUT_S))
            except ServiceUnavailableError:
                if fail_fast:
                    raise
            except DeadlineExceededError:
                pass
            else:
                if stats.applied_stream_seq >= stream_seq:
                    return stats
            await asyncio.sleep(min(delay_s, max(0.0, deadline - loop.time())))
            delay_s = min(delay_s * 2, 0.1)

"""Bus handlers of the index: match and stats (decoding and validation happen in the bus).

A match runs in an `index.match` span continuing the caller's trace (the router's index lookup).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.index import metrics
from services.index.config import IndexConfig
from services.index.index import BlockIndex, as_keys
from shared import telemetry
from shared.bus import MsgContext
from shared.errors import InvalidRequestError
from shared.protocol.kv import IndexMatchReply, IndexMatchRequest, IndexStats, IndexStatsRequest


class IndexHandlers:
    """Takes the block index, the service's config (limits) and where the index's stats come from."""

    def __init__(self, index: BlockIndex, config: IndexConfig, stats: Callable[[], IndexStats]) -> None:
        self.index = index
        self.config = config
        self.get_stats = stats

    async def match(self, msg: IndexMatchRequest, ctx: MsgContext) -> IndexMatchReply:
        started = time.perf_counter()
        with telemetry.span("index.match", parent=ctx.trace_parent) as span:
            reply = self._match(msg)
            if span is not None:
                span.set_attributes(
                    {"num_blocks": len(msg.block_hashes), "num_hit_blocks": reply.num_hit_blocks}
                )
        metrics.MATCH_SECONDS.observe(time.perf_counter() - started)
        metrics.MATCH_BLOCKS.labels("hit").inc(reply.num_hit_blocks)
        metrics.MATCH_BLOCKS.labels("miss").inc(len(msg.block_hashes) - reply.num_hit_blocks)
        return reply

    def _match(self, msg: IndexMatchRequest) -> IndexMatchReply:
        hashes = msg.block_hashes
        limit = self.config.max_match_blocks
        if len(hashes) > limit:
            raise InvalidRequestError(
                f"at most {limit} block hashes per match, got {len(hashes)}", param="block_hashes"
            )
        try:
            keys = as_keys(hashes)  # checks the range too, in C (a min/max over the list cost ~15 us)
        except (OverflowError, TypeError):
            raise InvalidRequestError(
                "block hashes are unsigned 64-bit integers", param="block_hashes"
            ) from None
        out = self.index.match(keys)
        return IndexMatchReply(
            num_hit_blocks=out.num_hit_blocks, per_tier=out.per_tier, per_location=out.per_location
        )

    async def stats(self, msg: IndexStatsRequest, ctx: MsgContext) -> IndexStats:
        return self.get_stats()

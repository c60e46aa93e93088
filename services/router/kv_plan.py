"""The KV part of a request's plan: the prompt's block hashes (computed here, once per request) and how many
leading blocks are stored (asked of the index)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.router import metrics
from shared import telemetry
from shared.blocks import max_hit_blocks
from shared.bus import Bus
from shared.errors import KvpathError
from shared.hashing import block_hashes
from shared.kvclient import IndexClient, MatchResult
from shared.protocol import KvFormat, KvPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlannedKv:
    """The KV part of a request's plan, and (router-side only) how many leading blocks of its prompt each
    location holds: `hbm:<engine>`, `dram:<engine>`, `cxl:<pool>`, `store` (the index's per-location answer),
    which cache-aware routing weighs."""

    kv: KvPlan
    blocks_by_location: Mapping[str, int] = field(default_factory=dict)


class KvPlanner:
    """Hashes a prompt's full blocks with the engines' KV format and asks the index for the longest stored
    prefix among the first `max_hit_blocks` of them.

    The hashes of every full block travel to the engines, which persist the blocks under them; with
    `use_index` off (no KV reuse) nothing is looked up. An index that is down or slow is a miss (the request
    recomputes), counted by outcome.
    """

    def __init__(self, bus: Bus, *, use_index: bool, timeout_s: float) -> None:
        self.index = IndexClient(bus) if use_index else None
        self.timeout_s = timeout_s

    async def plan(
        self, token_ids: list[int], kv_format: KvFormat, request_id: str, salt: int = 0
    ) -> PlannedKv:
        """`salt`: the request's chain salt (`shared.hashing.kv_salt`): only equally salted requests hit."""
        hashes = block_hashes(token_ids, kv_format.block_size, kv_format.fingerprint, salt)
        usable = hashes[: max_hit_blocks(len(token_ids), kv_format.block_size)]
        if self.index is None or not usable:
            return PlannedKv(KvPlan(block_hashes=hashes, salt=salt))
        result = await self._lookup(usable, request_id)
        hits = min(result.num_hit_blocks, len(usable))
        return PlannedKv(KvPlan(block_hashes=hashes, num_hit_blocks=hits, salt=salt), result.per_location)

    async def _lookup(self, hashes: list[int], request_id: str) -> MatchResult:
        assert self.index is not None
        with telemetry.span("index.lookup") as span:
            try:
                result = await self.index.match(hashes, timeout_s=self.timeout_s)
            except KvpathError as exc:
                metrics.INDEX_LOOKUPS.labels("error").inc()
                log.warning("index lookup failed request_id=%s: %s", request_id, exc.message)
                if span is not None:
                    span.set_attributes({"outcome": "error", "error.code": exc.code})
                return MatchResult(0)
            if span is not None:
                span.set_attributes({"num_blocks": len(hashes), "num_hit_blocks": result.num_hit_blocks})
        metrics.INDEX_LOOKUPS.labels("hit" if result.num_hit_blocks else "miss").inc()
        log.debug(
            "index lookup request_id=%s hit_blocks=%d/%d", request_id, result.num_hit_blocks, len(hashes)
        )
        return result

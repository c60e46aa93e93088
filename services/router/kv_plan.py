"""The KV part of a request's plan: the prompt's block hashes (computed here, once per request) and how many
leading blocks are stored (asked of the index)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
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


class Undecided:
    """Requests whose KV plan is being made and whose engine (and move-the-query primitive) is not chosen yet,
    with their block hashes: the sub-agents of a burst that reached the router together, which the routing
    counts (`kvpath_router_movequery_burst_size`; the simulator also prices a burst as one, `burst_wait_s`
    in `services/policy/movequery.py`, which the router does not yet). A request leaves when its plan is
    applied (`discard`); one that failed before that is dropped after `max_age_s` (its lookup's deadline
    has long passed, so it is no longer being decided)."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._hashes: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, request_id: str, hashes: list[int]) -> None:
        now = time.monotonic()
        self._prune(now)  # also where nothing prices a burst (a dispatch that never applies a plan)
        if hashes:
            self._hashes[request_id] = (now, hashes)
            self._hashes.move_to_end(request_id)

    def discard(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

    def _prune(self, now: float) -> None:
        while self._hashes:
            request_id, (at, _) = next(iter(self._hashes.items()))
            if at >= now - self.max_age_s:
                return
            del self._hashes[request_id]

    def sharing(self, request_id: str, hashes: list[int], num_blocks: int) -> int:
        """How many other undecided requests share the first `num_blocks` blocks of `hashes` (a chain hash
        names its whole prefix, so the last of them decides)."""
        if num_blocks <= 0 or len(hashes) < num_blocks:
            return 0
        self._prune(time.monotonic())
        key = hashes[num_blocks - 1]
        return sum(
            1
            for other, (_, h) in self._hashes.items()
            if other != request_id and len(h) >= num_blocks and h[num_blocks - 1] == key
        )


class KvPlanner:
    """Hashes a prompt's full blocks with the engines' KV format and asks the index for the longest stored
    prefix among the first `max_hit_blocks` of them.

    The hashes of every full block travel to the engines, which persist the blocks under them; with
    `use_index` off (no KV reuse) nothing is looked up. An index that is down or slow is a miss (the request
    recomputes), counted by outcome. `undecided`: where requests wait for their engine while planned (the
    router's move-the-query routing counts a burst there), None when nothing counts them.
    """

    def __init__(self, bus: Bus, *, use_index: bool, timeout_s: float) -> None:
        self.index = IndexClient(bus) if use_index else None
        self.timeout_s = timeout_s
        self.undecided: Undecided | None = None

    def decided(self, request_id: str) -> None:
        """The request no longer waits for its engine (dispatched, or failed before)."""
        if self.undecided is not None:
            self.undecided.discard(request_id)

    async def plan(
        self, token_ids: list[int], kv_format: KvFormat, request_id: str, salt: int = 0
    ) -> PlannedKv:
        """`salt`: the request's chain salt (`shared.hashing.kv_salt`): only equally salted requests hit."""
        hashes = block_hashes(token_ids, kv_format.block_size, kv_format.fingerprint, salt)
        usable = hashes[: max_hit_blocks(len(token_ids), kv_format.block_size)]
        if self.index is None or not usable:
            return PlannedKv(KvPlan(block_hashes=hashes, salt=salt))
        if self.undecided is not None:  # from before the lookup: a burst's requests wait on it together
            self.undecided.add(request_id, usable)
        result = await self._lookup(usable, request_id)
        hits = min(result.num_hit_blocks, len(usable))
        return PlannedKv(KvPlan(block_hashes=hashes, num_hit_blocks=hits, salt=salt), result.per_location)

    async def num_stored(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the index lists anywhere now (0 without an index, or when it
        does not answer)."""
        if self.index is None or not hashes:
            return 0
        try:
            return (await self.index.match(hashes, timeout_s=self.timeout_s)).num_hit_blocks
        except KvpathError:
            return 0

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

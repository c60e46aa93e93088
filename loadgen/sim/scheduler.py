"""The global scheduler on the simulated clock: a FIFO of waiting requests and, on a change, one call of the
round function the live router runs (`services/policy/round.py` `place_table_round`) over the
engines' unfinished requests and tokens, free KV and node read queues, with `thresholds_from_rates` from the
nodes' read rates and the PEs' measured prefill rates. The loads are a `LoadTable` the cluster keeps up to
date (only engines whose loads changed are rewritten), not a snapshot rebuilt per round.

One simulator-only choice, which changes no decision: rounds are coalesced, at most one per `fetch_period_s`
(the paper's engines fetch periodically; the live router runs one per arrival and per load report).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadgen.sim.events import PRIORITY_LATE, EventLoop
from loadgen.sim.requests import SimRequest
from services.policy.load_table import LoadTable
from services.policy.round import RoundState, place_table_round
from services.policy.short_first import (
    PAST_BETA_TRIES,
    PrefillQueue,
    WaitingPrefill,
    past_beta_prefix,
    postponements,
    short_first_order,
)
from services.policy.snapshot import PendingRequest, Placement
from services.policy.thresholds import Thresholds
from shared.errors import KvpathError


@dataclass(slots=True)
class SchedulerCost:
    """Wall time spent deciding (snapshot + thresholds + round function), rounds that called `place`, rounds
    skipped as provably empty, and placed requests."""

    seconds: float = 0.0
    num_rounds: int = 0
    num_placed: int = 0
    max_round_s: float = 0.0
    max_queue: int = 0
    place_seconds: float = 0.0  # inside the round function alone
    num_skipped: int = 0  # rounds that provably could place nothing (no `place` call)


class GlobalScheduler:
    def __init__(
        self,
        loop: EventLoop,
        policy: str,
        fetch_period_s: float,
        load_table: Callable[[], LoadTable],
        thresholds: Callable[[], Thresholds],
        on_placed: Callable[[SimRequest, Placement], None],
        *,
        prefill_queue: Callable[[str], PrefillQueue | None] | None = None,
    ) -> None:
        self.loop = loop
        self.policy = policy
        self.fetch_period_s = fetch_period_s
        self._load_table = load_table
        self._thresholds = thresholds
        self._on_placed = on_placed
        self.fifo: deque[SimRequest] = deque()
        self._pending: deque[PendingRequest] = deque()  # the FIFO as the round function reads it
        self.state = RoundState()
        self.cost = SchedulerCost()
        self._is_round_pending = False
        self._last_round_s = -1e300
        # short-first (`prefill_queue` given: each PE's queue as a short-first PE reports it): the queue is
        # offered shortest first and past beta too; request id -> compute tokens placed ahead of it so far
        self.prefill_queue = prefill_queue
        self._postponed: dict[str, int] = {}

    def enqueue(self, request: SimRequest) -> None:
        self.fifo.append(request)
        self._pending.append(request.pending)
        self.cost.max_queue = max(self.cost.max_queue, len(self.fifo))
        self.request_round()

    def request_round(self) -> None:
        """Something changed: run a round (now, or when the fetch period allows) if requests wait."""
        if self._is_round_pending or not self.fifo:
            return
        self._is_round_pending = True
        at = max(self.loop.now, self._last_round_s + self.fetch_period_s)
        self.loop.at(at, self._run_round, priority=PRIORITY_LATE)

    def _run_round(self) -> None:
        self._is_round_pending = False
        self._last_round_s = self.loop.now
        if not self.fifo:
            return
        if self.prefill_queue is not None:
            self._run_short_first_round()
            return
        cost = self.cost
        started = time.perf_counter()
        placements = self.decide()
        elapsed = time.perf_counter() - started
        cost.seconds += elapsed
        cost.num_placed += len(placements)
        cost.max_round_s = max(cost.max_round_s, elapsed)
        by_id = {}
        for _ in placements:
            request = self.fifo.popleft()
            self._pending.popleft()
            by_id[request.request_id] = request
        for placement in placements:
            self._on_placed(by_id[placement.request_id], placement)

    def _run_short_first_round(self) -> None:
        """The live router's short-first round: the queue offered shortest first, then (the first round's
        placements applied to the loads) one round with beta lifted over the first `PAST_BETA_TRIES` left,
        standing while each PE's short-first queue takes them (`past_beta_prefix`)."""
        started = time.perf_counter()
        tasks = [_waiting(p, self._postponed.get(p.request_id, 0)) for p in self._pending]
        order = short_first_order(tasks)
        offered = [self._pending[i] for i in order]
        by_id = {r.request_id: r for r in self.fifo}
        placed = list(self._place(offered, self._thresholds(), by_id))
        done = {p.request_id for p in placed}
        tries = [p for p in offered if p.request_id not in done][:PAST_BETA_TRIES]
        if tries and self.prefill_queue is not None:
            t = self._thresholds()
            lifted = Thresholds(t.alpha_tokens, math.inf, t.z_factor)
            result = place_table_round(self.policy, self._load_table(), tries, lifted, self.state)
            tokens = {p.request_id: _waiting(p, 0).tokens_left for p in tries}
            n = past_beta_prefix(result.placements, tokens, self.prefill_queue)
            if n:
                self.state = result.state
            for placement in result.placements[:n]:
                self._on_placed(by_id[placement.request_id], placement)
                placed.append(placement)
        self._remove(placed, tasks)
        elapsed = time.perf_counter() - started
        self.cost.seconds += elapsed
        self.cost.num_placed += len(placed)
        self.cost.max_round_s = max(self.cost.max_round_s, elapsed)

    def _place(
        self, offered: list[PendingRequest], thresholds: Thresholds, by_id: dict[str, SimRequest]
    ) -> tuple[Placement, ...]:
        """One round over `offered` (the round function), its placements applied to the loads."""
        result = place_table_round(self.policy, self._load_table(), offered, thresholds, self.state)
        if result.missing_roles:
            raise KvpathError(f"simulated cluster has no {' or '.join(result.missing_roles)} engine")
        self.cost.num_skipped += result.is_skipped
        self.cost.num_rounds += not result.is_skipped
        self.state = result.state
        for placement in result.placements:
            self._on_placed(by_id[placement.request_id], placement)
        return result.placements

    def _remove(self, placed: list[Placement], tasks: list[WaitingPrefill]) -> None:
        """Take the placed requests out of the queue; charge the ones they passed."""
        if not placed:
            return
        index = {p.request_id: i for i, p in enumerate(self._pending)}
        added = postponements(tasks, [index[p.request_id] for p in placed])
        done = {p.request_id for p in placed}
        for p, extra in zip(self._pending, added, strict=True):
            if extra and p.request_id not in done:
                self._postponed[p.request_id] = self._postponed.get(p.request_id, 0) + extra
        for rid in done:
            self._postponed.pop(rid, None)
        self.fifo = deque(r for r in self.fifo if r.request_id not in done)
        self._pending = deque(p for p in self._pending if p.request_id not in done)

    def decide(self) -> Sequence[Placement]:
        """One round's placements (a FIFO prefix), as the live router's dispatcher decides them."""
        thresholds = self._thresholds()
        table = self._load_table()
        started = time.perf_counter()
        result = place_table_round(self.policy, table, self._pending, thresholds, self.state)
        self.cost.place_seconds += time.perf_counter() - started
        if result.missing_roles:
            raise KvpathError(f"simulated cluster has no {' or '.join(result.missing_roles)} engine")
        if result.is_skipped:
            self.cost.num_skipped += 1
        else:
            self.cost.num_rounds += 1
        self.state = result.state
        return result.placements


def _waiting(request: PendingRequest, postponed: int) -> WaitingPrefill:
    """A queued request as the short-first rule sees it: the tokens its PE computes (at least one)."""
    compute = max(1, request.prompt_tokens - request.hit_tokens)
    return WaitingPrefill(compute, compute, postponed)

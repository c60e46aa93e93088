"""The global scheduler on the simulated clock, invoked the way the live router invokes it
(services/router/disagg.py `Dispatcher.round`): a FIFO of waiting requests; on a change, a `ClusterSnapshot`
of the engines' unfinished requests and tokens, free KV and node read queues, `thresholds_from_rates` from the
nodes' read rates and the PEs' measured prefill rates, then `place(policy, ...)`.

Two simulator-only choices, neither changing a decision:
* Rounds are coalesced: at most one per `fetch_period_s` (the paper's engines fetch periodically; the live
  router runs one per arrival and per load report).
* The snapshot carries a window at the head of the FIFO instead of all of it. A policy's placements are a
  FIFO prefix, and under `dualpath` / `basic` everything after the PE stage looks only at the requests that
  got a PE, so the window's result equals the whole queue's unless the PE stage used the whole window; then
  the window doubles and the round is redone. Under `dualpath-rr` each request depends only on those before
  it, so a window that is not fully placed is exact too. `tests/unit/sim` checks the equality.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

from loadgen.sim.events import PRIORITY_LATE, EventLoop
from loadgen.sim.requests import SimRequest
from services.router.dualpath import (
    ClusterSnapshot,
    EngineSnapshot,
    NodeSnapshot,
    Placement,
    RoundRobinState,
    Thresholds,
)
from services.router.placement import place, select_prefill_engines

MIN_WINDOW = 64


@dataclass(slots=True)
class SchedulerCost:
    """Wall time spent deciding (snapshot + thresholds + place), rounds that called `place`, rounds skipped
    as provably empty, and placed requests."""

    seconds: float = 0.0
    num_rounds: int = 0
    num_placed: int = 0
    max_round_s: float = 0.0
    max_queue: int = 0
    place_seconds: float = 0.0  # inside `place` alone
    num_skipped: int = 0  # rounds that provably could place nothing (no snapshot, no `place`)


class GlobalScheduler:
    def __init__(
        self,
        loop: EventLoop,
        policy: str,
        fetch_period_s: float,
        snapshot_parts: Callable[[], tuple[tuple[EngineSnapshot, ...], tuple[NodeSnapshot, ...]]],
        thresholds: Callable[[], Thresholds],
        can_place_head: Callable[[Thresholds, SimRequest], bool],
        on_placed: Callable[[SimRequest, Placement], None],
    ) -> None:
        self.loop = loop
        self.policy = policy
        self.fetch_period_s = fetch_period_s
        self._snapshot_parts = snapshot_parts
        self._thresholds = thresholds
        self._can_place_head = can_place_head
        self._on_placed = on_placed
        self.fifo: deque[SimRequest] = deque()
        self.rr_state = RoundRobinState()
        self.cost = SchedulerCost()
        self._is_round_pending = False
        self._last_round_s = -1e300
        self._window = MIN_WINDOW

    def enqueue(self, request: SimRequest) -> None:
        self.fifo.append(request)
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
        cost = self.cost
        skipped = cost.num_skipped
        started = time.perf_counter()
        placements = self.decide()
        elapsed = time.perf_counter() - started
        cost.seconds += elapsed
        if cost.num_skipped == skipped:  # skipped rounds are counted apart
            cost.num_rounds += 1
        cost.num_placed += len(placements)
        cost.max_round_s = max(cost.max_round_s, elapsed)
        by_id = {}
        for _ in placements:
            request = self.fifo.popleft()
            by_id[request.request_id] = request
        for placement in placements:
            self._on_placed(by_id[placement.request_id], placement)

    def decide(self) -> Sequence[Placement]:
        """One round's placements (a FIFO prefix), identical to `place` over the whole queue."""
        thresholds = self._thresholds()
        if not self._can_place_head(thresholds, self.fifo[0]):
            self.cost.num_skipped += 1
            return ()
        engines, nodes = self._snapshot_parts()
        window = self._window
        while True:
            head = tuple(r.pending for r in islice(self.fifo, window))
            snapshot = ClusterSnapshot(engines=engines, nodes=nodes, queue=head)
            if len(head) < len(self.fifo) and self._is_window_exhausted(snapshot, thresholds, len(head)):
                window *= 2
                continue
            started = time.perf_counter()
            result = place(self.policy, snapshot, thresholds, self.rr_state)
            self.cost.place_seconds += time.perf_counter() - started
            if self.policy == "dualpath-rr" and len(result.placements) == len(head) < len(self.fifo):
                window *= 2
                continue
            break
        self.rr_state = result.rr_state
        self._window = max(MIN_WINDOW, 2 * len(result.placements), window // 2)
        return result.placements

    def _is_window_exhausted(self, snapshot: ClusterSnapshot, thresholds: Thresholds, size: int) -> bool:
        if self.policy == "dualpath-rr":
            return False  # checked on the result instead
        pe_ids = select_prefill_engines(
            snapshot, thresholds, use_read_queue_categories=self.policy == "dualpath"
        )
        return len(pe_ids) >= size

"""The engine's prefill orders: which waiting sequence its scheduler admits next. AMPD's Algorithm 2
(`--prefill-order slo`; the policy itself is `services/policy/ampd_reorder.py`) and shortest first
(`--prefill-order short-first`: `services/policy/short_first.py`).

The scheduler calls the order before each admission from its waiting queue; it reorders the head of the queue
so that the head runs next. Sequences whose first token is out already (a prompt prefilled on another engine
waiting for its import, a preempted sequence to recompute) have no TTFT left to meet: nothing is reordered
across them (they run in their FIFO turn). A task's estimated prefill time comes from the engine's cost
model: the profile file (`--cost-profile`) or, without one, the prefill rate this engine measures.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from services.engine.config import EngineConfig
from services.engine.scheduler import EngineScheduler, waiting_prefill
from services.engine.sequence import Sequence
from services.engine.step_budget import adaptive_budget
from services.policy.ampd_costs import CostModel, linear_cost_model
from services.policy.ampd_reorder import QueuedPrefill, next_order
from services.policy.quota import QuotaPlanner, RateMeter
from services.policy.short_first import WaitingPrefill, next_shortest
from services.policy.thresholds import FALLBACK_PREFILL_TOKENS_PER_S


class SloPrefillOrder:
    def __init__(
        self,
        costs: Callable[[], CostModel],
        *,
        kind: str,
        window: int,
        default_ttft_slo_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.costs = costs  # the current model (a measured rate may refine it over time)
        self.kind = kind
        self.window = window
        self.default_ttft_slo_s = default_ttft_slo_s
        self.clock = clock

    def __call__(self, waiting: deque[Sequence], start: int) -> None:
        head: list[Sequence] = []
        for i in range(start, min(len(waiting), start + self.window)):
            if waiting[i].output_token_ids:
                break  # nothing is reordered across a sequence whose first token is out
            head.append(waiting[i])
        if len(head) < 2:
            return
        now, costs = self.clock(), self.costs()
        chosen = next_order([self._queued(s, now, costs) for s in head], self.window)
        if chosen.order == tuple(range(len(head))):
            return
        for j in chosen.postponed:
            head[j].num_postponed += 1
        for offset, k in enumerate(chosen.order):
            waiting[start + offset] = head[k]

    def _queued(self, seq: Sequence, now: float, costs: CostModel) -> QueuedPrefill:
        done = max(seq.num_computed_tokens, seq.num_hit_tokens)
        return QueuedPrefill(
            waited_s=now - seq.arrived_at,
            prefill_s=costs.prefill_s(done, seq.prefill_target - done, self.kind),
            ttft_slo_s=seq.plan.ttft_slo_s or self.default_ttft_slo_s,
            num_postponed=seq.num_postponed,
        )


class ShortFirstOrder:
    """Shortest prefill first over the next `scan` waiting sequences (up to one whose first token is out),
    none postponed past `ratio` x its own compute (services/policy/short_first.py)."""

    def __init__(self, ratio: float, scan: int = 64) -> None:
        self.ratio = ratio
        self.scan = scan  # a long queue is ordered by its head: admission stays O(scan)

    def __call__(self, waiting: deque[Sequence], start: int) -> None:
        head: list[WaitingPrefill] = []
        for i in range(start, min(len(waiting), start + self.scan)):
            if waiting[i].output_token_ids:
                break  # nothing is reordered across a sequence whose first token is out
            head.append(waiting_prefill(waiting[i]))
        chosen = next_shortest(head, self.ratio) if len(head) > 1 else 0
        if chosen == 0:
            return
        # counted when reordered: a head that then does not fit (the cache short) counts again at the next
        # try, which only closes the tasks it passed sooner (toward first come, first served)
        for i in range(start, start + chosen):
            waiting[i].postponed_tokens += head[chosen].tokens_left
        seq = waiting[start + chosen]
        del waiting[start + chosen]
        waiting.insert(start, seq)


def build_prefill_order(config: EngineConfig, rate: RateMeter) -> SloPrefillOrder | ShortFirstOrder | None:
    """The engine's prefill order: None for first come, first served; shortest first for `short-first`;
    Algorithm 2 for `slo`, its estimates from the profile file when one is given, else from the prefill rate
    the engine measures (`rate`)."""
    if config.prefill_order == "short-first":
        return ShortFirstOrder(config.short_first_ratio)
    if config.prefill_order != "slo":
        return None
    if config.cost_profile:
        profiled = CostModel.from_dict(json.loads(Path(config.cost_profile).read_text()))
        costs: Callable[[], CostModel] = lambda: profiled  # noqa: E731
    else:
        costs = _MeasuredCosts(rate).current
    return SloPrefillOrder(
        costs, kind=config.role, window=config.reorder_window, default_ttft_slo_s=config.ttft_slo_s
    )


class _MeasuredCosts:
    """A linear T_pre from the engine's measured prefill rate, rebuilt when the rate moves by over 10%."""

    def __init__(self, rate: RateMeter) -> None:
        self.rate = rate
        self._model = self._build(FALLBACK_PREFILL_TOKENS_PER_S)

    def _build(self, tokens_per_s: float) -> CostModel:
        return linear_cost_model(
            prefill_tokens_per_s=tokens_per_s, decode_step_s=0.0, kv_bytes_per_token=1, link_bytes_per_s={}
        )

    def current(self) -> CostModel:
        measured = self.rate.value
        if measured > 0:
            modelled = 1.0 / self._model.prefill_s(0, 1)
            if abs(measured - modelled) > 0.1 * modelled:
                self._model = self._build(measured)
        return self._model


def configure_scheduler(
    scheduler: EngineScheduler, config: EngineConfig, quota: QuotaPlanner | None, compute_rate: RateMeter
) -> None:
    """The scheduler's prefill order (`--prefill-order`: slo from the compute rate measured here,
    short-first with its ratio) and its step budget (`--step-target-s`, services/engine/step_budget.py)."""
    scheduler.prefill_order = build_prefill_order(config, compute_rate)
    scheduler.step_budget = adaptive_budget(config, quota, compute_rate)
    if config.prefill_order == "short-first":
        scheduler.short_first_ratio = config.short_first_ratio

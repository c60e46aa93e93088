"""Discrete-event model of a cluster serving multi-round sessions the AMPD way (brief §4.4, §7.2).

Prefill engines (PEs) run one prefill at a time from their queue; decode engines (DEs) keep each bound
session's KV and alternate between their local prefill queue (a local prefill pauses the decode batch, as
vLLM does) and decode steps of the running batch (continuous batching: a session joins at the next step).
Every decision is the project's own policy code: binding and Algorithm 1 (`services/policy/ampd.py`, by
routing mode: AMPD, always remote, always local), Algorithm 2 (`ampd_reorder.py`), the windowed statistics
(`ampd_stats.py`) and the cost model (`ampd_costs.py`), which is both the simulated truth and the estimate.
Remote prefill reads the history from the DE before computing (lazy, at dequeue) and returns the new KV;
TTFT ends when that KV (and the first token) is on the DE.

Memory (brief §7.2, §8 #19): each DE (a colocated replica too) holds `kv_capacity_tokens` of KV, the bound
sessions' contexts from arrival to their last token (a session keeps its KV through tool calls, §4.1).
Binding reads that occupancy (lowest share, then fewest running, then id: §4.1); a session whose first prompt
fits no DE waits for one in arrival order, the wait counted in its first TTFT, and `SimCounts` reports how
many waited. The paper never discusses eviction, so a bound session's later rounds are not refused: a DE that
grows past its capacity is counted (`over_capacity`), not evicted.
"""

from __future__ import annotations

import functools
import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from services.policy.ampd import (
    AmpdParams,
    DecodeOccupancy,
    DecodeView,
    PrefillView,
    TurnPrefill,
    bind_session,
    route_by_mode,
)
from services.policy.ampd_costs import ROLE_DECODE, ROLE_PREFILL, CostModel
from services.policy.ampd_reorder import QueuedPrefill, next_order
from services.policy.ampd_slo import ITL_MEAN, RoundLatency, SessionSlo, meets_slo
from services.policy.ampd_stats import EngineWindows
from services.policy.short_first import WaitingPrefill, next_shortest

SHORT_FIRST_SCAN = 64  # the engines' ShortFirstOrder scan (services/engine/slo_order.py)


@dataclass(slots=True)
class SimSession:
    sid: str
    rounds: list[tuple[int, int, float]]  # (new tokens, generated tokens, tool latency after the round)
    ttft_slo_s: float
    itl_slo_s: float
    engine: DecodeSim | None = None
    arrived_at: float = 0.0
    ctx: int = 0  # tokens whose KV the bound DE holds
    kv_held: int = 0  # tokens counted in the DE's occupancy (the first prompt from binding on)
    round: int = 0
    remaining: int = 0  # tokens still to decode this round
    last_token_at: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    itl_sum_s: float = 0.0
    itl_tokens: int = 0
    gaps: list[list[float]] = field(default_factory=list)  # per round, the gaps after its first token
    is_done: bool = False

    def latencies(self) -> list[RoundLatency]:
        return [RoundLatency(t, sum(g), len(g), g) for t, g in zip(self.ttfts, self.gaps, strict=True)]

    def meets_slo(self, itl_stat: str = ITL_MEAN) -> bool:
        """The SLO as `services/policy/ampd_slo.py` defines it (default: every round's TTFT and the
        session's mean ITL, brief §8 #1); an unfinished session misses it."""
        slo = SessionSlo(self.ttft_slo_s, self.itl_slo_s, itl_stat)
        return self.is_done and meets_slo(self.latencies(), slo)


@dataclass(slots=True)
class Task:
    session: SimSession
    l_hist: int
    l_incr: int
    t_enq: float
    num_postponed: int = 0
    postponed_tokens: int = 0  # shortest-first order: compute admitted ahead of it


@dataclass(slots=True)
class Worker:
    engine_id: str
    kind: str
    queue: list[Task] = field(default_factory=list)
    is_busy: bool = False
    compute_start: float = float("-inf")  # when the last prefill started computing


@dataclass(slots=True)
class DecodeSim(Worker):
    running: list[SimSession] = field(default_factory=list)
    bound: list[SimSession] = field(default_factory=list)  # sessions holding KV here (not yet done)
    kv_tokens: int = 0  # the bound sessions' contexts


@dataclass(slots=True)
class SimCounts:
    local: int = 0
    remote: int = 0
    admission_waits: int = 0  # sessions that waited for KV memory before binding
    over_capacity: int = 0  # times a bound session's growth took a DE past its KV capacity (no eviction)

    @property
    def local_share(self) -> float:
        total = self.local + self.remote
        return self.local / total if total else 0.0


class AmpdCluster:
    """`mode`: a routing mode of services.policy.ampd (ampd, remote-rr, remote-lq, local); `reorder`:
    Algorithm 2 on every prefill queue (else FCFS); `short_first`: the engines' `--prefill-order
    short-first` on every prefill queue instead (services/policy/short_first.py)."""

    def __init__(
        self,
        costs: CostModel,
        *,
        num_prefill: int,
        num_decode: int,
        mode: str,
        link: str,
        params: AmpdParams = AmpdParams(),
        reorder: bool = True,
        short_first: bool = False,
        window: int = 3,
        seed: int = 0,
        kv_capacity_tokens: int = 1 << 40,
    ) -> None:
        self.costs, self.mode, self.link, self.params = costs, mode, link, params
        self.kv_capacity_tokens = kv_capacity_tokens
        self.admission: list[SimSession] = []  # arrived, waiting for a DE with room for the first prompt
        self.reorder, self.window = reorder, window
        self.short_first = short_first
        self.prefills = [Worker(f"pe{i}", ROLE_PREFILL) for i in range(num_prefill)]
        self.decodes = [DecodeSim(f"de{i}", ROLE_DECODE) for i in range(num_decode)]
        self._by_id = {w.engine_id: w for w in self.prefills}
        self.ttft = EngineWindows()
        self.itl = EngineWindows()
        self.rng = random.Random(seed)
        self.rr_cursor = 0
        self.counts = SimCounts()
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    # ------------------------------------------------------------------------------------ event loop

    def at(self, t: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, action))

    def run(self, arrivals: list[tuple[float, SimSession]]) -> list[SimSession]:
        for t, session in arrivals:
            self.at(t, functools.partial(self._arrive, session))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return [s for _, s in arrivals]

    # -------------------------------------------------------------------------------------- sessions

    def _arrive(self, s: SimSession) -> None:
        s.arrived_at = self.now
        if self.admission or not self._bind(s):
            self.counts.admission_waits += 1
            self.admission.append(s)

    def _bind(self, s: SimSession) -> bool:
        """Bind `s` to the least occupied DE with room for its first prompt (§4.1, §7.2); False: none has."""
        need = s.rounds[0][0] + 1
        loads = [
            DecodeOccupancy(d.engine_id, d.kv_tokens, self.kv_capacity_tokens, len(d.running))
            for d in self.decodes
            if d.kv_tokens + need <= self.kv_capacity_tokens
        ]
        engine_id = bind_session(loads)
        if engine_id is None:
            return False
        s.engine = next(d for d in self.decodes if d.engine_id == engine_id)
        s.engine.bound.append(s)
        s.engine.kv_tokens += need  # the first prompt's KV is allotted on binding
        s.kv_held = need
        self._new_task(s, s.arrived_at)
        return True

    def _release(self, s: SimSession) -> None:
        """A finished session frees its KV; sessions waiting for memory bind in arrival order."""
        de = s.engine
        assert de is not None
        de.bound.remove(s)
        de.kv_tokens -= s.kv_held
        if self.admission:  # as its own event: the caller may be mid-way through a decode step's tokens
            self.at(self.now, self._admit)

    def _admit(self) -> None:
        while self.admission and self._bind(self.admission[0]):
            self.admission.pop(0)

    def _grow(self, s: SimSession, tokens: int) -> None:
        de = s.engine
        assert de is not None
        s.ctx += tokens
        before = de.kv_tokens
        de.kv_tokens += max(0, s.ctx - s.kv_held)
        s.kv_held = max(s.kv_held, s.ctx)
        self.counts.over_capacity += before <= self.kv_capacity_tokens < de.kv_tokens

    def _new_task(self, s: SimSession, t_enq: float | None = None) -> None:
        l_incr = s.rounds[s.round][0]
        task = Task(s, s.ctx, l_incr, self.now if t_enq is None else t_enq)
        de = s.engine
        assert de is not None
        turn = TurnPrefill(s.ctx, l_incr, s.ctx, 0, s.ttft_slo_s, s.itl_slo_s)
        views = [
            PrefillView(p.engine_id, self.ttft.mean(p.engine_id, self.now), _work(p)) for p in self.prefills
        ]
        self.rng.shuffle(views)  # Algorithm 1: "in random order"
        decode = DecodeView(de.engine_id, self.itl.mean(de.engine_id, self.now), _work(de))
        decision, self.rr_cursor = route_by_mode(
            self.mode, turn, decode, views, self.costs, self.params, self.rr_cursor
        )
        assert decision is not None, "a remote mode without prefill engines"
        worker: Worker = de if decision.is_local else self._by_id[decision.target]
        self.counts.local += decision.is_local
        self.counts.remote += not decision.is_local
        worker.queue.append(task)
        self._kick(worker)

    def _end_round(self, s: SimSession) -> None:
        tool_s = s.rounds[s.round][2]
        s.round += 1
        if s.round == len(s.rounds):
            s.is_done = True
            self._release(s)
            return
        self.at(self.now + tool_s, lambda: self._new_task(s))

    # --------------------------------------------------------------------------------------- workers

    def _pick(self, worker: Worker) -> Task:
        queue = worker.queue
        if self.short_first and len(queue) > 1:
            return _pop_shortest(queue)
        if self.reorder and len(queue) > 1:
            head = [
                QueuedPrefill(
                    self.now - t.t_enq,
                    self.costs.prefill_s(t.l_hist, t.l_incr, worker.kind),
                    t.session.ttft_slo_s,
                    t.num_postponed,
                )
                for t in queue[: self.window]
            ]
            chosen = next_order(head, self.window)
            window = queue[: len(head)]
            for j in chosen.postponed:
                window[j].num_postponed += 1
            queue[: len(head)] = [window[k] for k in chosen.order]
        return queue.pop(0)

    def _kick(self, worker: Worker) -> None:
        if worker.is_busy:
            return
        if isinstance(worker, DecodeSim):
            self._decode_step(worker)
        elif worker.queue:
            self._remote_prefill(worker)

    def _remote_prefill(self, pe: Worker) -> None:
        task = self._pick(pe)
        # the history from the DE, read at dequeue (lazy) but overlapped with the previous task's compute
        # (paper §6): only what is left of the read since the task was queued behind that compute waits
        read_s = self.costs.kv_s(task.l_hist, self.link)
        read_s = max(0.0, read_s - (self.now - max(task.t_enq, pe.compute_start)))
        compute_s = self.costs.prefill_s(task.l_hist, task.l_incr, ROLE_PREFILL)
        pe.is_busy = True
        pe.compute_start = self.now + read_s

        def done() -> None:
            pe.is_busy = False
            back_s = self.costs.kv_s(task.l_incr, self.link)
            self.at(self.now + back_s, lambda: self._first_token(task, pe.engine_id))
            self._kick(pe)

        self.at(self.now + read_s + compute_s, done)

    def _decode_step(self, de: DecodeSim) -> None:
        if de.queue:  # a local prefill first: the decode batch waits for it
            task = self._pick(de)
            de.is_busy = True

            def prefilled() -> None:
                de.is_busy = False
                self._first_token(task, None)

            self.at(self.now + self.costs.prefill_s(task.l_hist, task.l_incr, ROLE_DECODE), prefilled)
            return
        if not de.running:
            return
        batch = list(de.running)
        step_s = self.costs.decode_step_s(len(batch), sum(s.ctx for s in batch), ROLE_DECODE)
        de.is_busy = True

        def stepped() -> None:
            de.is_busy = False
            for s in batch:
                self._token(de, s)
            self._kick(de)

        self.at(self.now + step_s, stepped)

    def _first_token(self, task: Task, pe_id: str | None) -> None:
        s, de = task.session, task.session.engine
        assert de is not None
        ttft = self.now - task.t_enq
        s.ttfts.append(ttft)
        s.gaps.append([])
        if pe_id is not None:
            self.ttft.add(pe_id, self.now, ttft)
        self._grow(s, task.l_incr + 1)
        s.remaining = s.rounds[s.round][1] - 1
        s.last_token_at = self.now
        if s.remaining > 0:
            de.running.append(s)
        else:
            self._end_round(s)
        self._kick(de)

    def _token(self, de: DecodeSim, s: SimSession) -> None:
        gap = self.now - s.last_token_at
        s.itl_sum_s += gap
        s.itl_tokens += 1
        s.gaps[-1].append(gap)
        self.itl.add(de.engine_id, self.now, gap)
        s.last_token_at = self.now
        self._grow(s, 1)
        s.remaining -= 1
        if s.remaining <= 0:
            de.running.remove(s)
            self._end_round(s)


def _work(worker: Worker) -> tuple[tuple[int, int], ...]:
    return tuple((t.l_hist, t.l_incr) for t in worker.queue)


def _pop_shortest(queue: list[Task]) -> Task:
    """The engines' shortest-first order (`ShortFirstOrder`, the same rule and scan): a task's compute is
    its new tokens, the history being resident on its DE or read by the PE."""
    waiting = [WaitingPrefill(t.l_incr, t.l_incr, t.postponed_tokens) for t in queue[:SHORT_FIRST_SCAN]]
    k = next_shortest(waiting)
    for t in queue[:k]:
        t.postponed_tokens += waiting[k].tokens_left
    return queue.pop(k)

"""One vLLM V1 instance on one GPU: continuous batching with chunked prefill, an HBM prefix cache, and the
shared tier behind it (`backends.py`).

A step is three parts, as the engine's: `_schedule` (running sequences first, one token per decode and a
chunk per prefill, then waiting ones in FCFS order while the token budget and HBM last), the execution
(`_load`: the loads of newly admitted sequences, one after another; `_compute`; `_save`: the stores of the
units the step completed) and `_apply` (first tokens, decode tokens, finishes). Loads and stores block the
step, as the connectors of vLLM 0.8.5 do (I), so a slow load also stalls every decoding sequence of its
instance. An HBM hit needs no load; what the shared tier holds beyond it is loaded.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from loadgen.sim.events import EventLoop
from loadgen.sim.pool.backends import Backend
from loadgen.sim.pool.compute import StepModel
from loadgen.sim.pool.costs import hit_cap_tokens
from loadgen.sim.pool.tiers import PrefixTier
from loadgen.sim.pool.workload import LvRequest


@dataclass(slots=True)
class Seq:
    """One request on its instance, from the client's send to its last token."""

    request: LvRequest
    sent_s: float
    on_finished: Callable[[Seq], None]
    computed_tokens: int = 0  # prompt tokens in HBM (hit, loaded or computed)
    output_tokens: int = 0
    hbm_hit_tokens: int = 0
    loaded_tokens: int = 0  # from the shared tier
    first_token_s: float = math.nan
    finish_s: float = math.nan
    load_s: float = 0.0

    @property
    def is_prefilling(self) -> bool:
        return self.computed_tokens < self.request.prompt_tokens

    @property
    def num_tokens(self) -> int:
        """What the engine reports as unfinished tokens (prompt + generated so far)."""
        return self.request.prompt_tokens + self.output_tokens


@dataclass(slots=True)
class StepPlan:
    pieces: list[tuple[Seq, int]] = field(default_factory=list)  # (sequence, new tokens)
    loads: list[tuple[Seq, int, int]] = field(default_factory=list)  # (sequence, start, stop tokens)
    saves: list[Seq] = field(default_factory=list)


class Instance:
    __slots__ = (
        "backend",
        "engine_id",
        "hbm",
        "is_busy",
        "loop",
        "reserved_blocks",
        "running",
        "server",
        "slot",
        "step_model",
        "step_tokens",
        "waiting",
    )

    def __init__(
        self,
        loop: EventLoop,
        server: int,
        slot: int,
        hbm: PrefixTier,
        backend: Backend,
        step_model: StepModel,
        step_tokens: int,
    ) -> None:
        self.loop = loop
        self.engine_id = f"s{server}g{slot}"
        self.server = server
        self.slot = slot
        self.hbm = hbm
        self.backend = backend
        self.step_model = step_model
        self.step_tokens = step_tokens
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.reserved_blocks = 0
        self.is_busy = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def unfinished_tokens(self) -> int:
        return sum(s.num_tokens for s in self.waiting) + sum(s.num_tokens for s in self.running)

    def local_hit_tokens(self, request: LvRequest) -> int:
        """Prompt tokens this instance's own tiers hold: its HBM, or its server's DRAM tier."""
        return max(self.hbm.match_tokens(request), self.backend.local_tokens(self.server, request))

    def submit(self, seq: Seq) -> None:
        self.waiting.append(seq)
        if not self.is_busy:
            self._step()

    # ------------------------------------------------------------------------------------------ schedule

    def _step(self) -> None:
        plan = self._schedule()
        self.is_busy = bool(plan.pieces)
        if self.is_busy:
            self._load(plan, 0)

    def _schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.step_tokens
        for seq in self.running:
            if budget <= 0:
                break
            new = min(seq.request.prompt_tokens - seq.computed_tokens, budget) if seq.is_prefilling else 1
            plan.pieces.append((seq, new))
            budget -= new
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            need = self._blocks_of(seq.request)
            if self.running and self.reserved_blocks + need > self.hbm.capacity_units:
                break  # no HBM for it until a running sequence finishes
            self.waiting.popleft()
            self._admit(seq, need, plan)
            new = min(seq.request.prompt_tokens - seq.computed_tokens, budget)
            plan.pieces.append((seq, new))
            budget -= new
        return plan

    def _blocks_of(self, request: LvRequest) -> int:
        return -(-(request.prompt_tokens + request.output_tokens) // self.hbm.unit_tokens)

    def _admit(self, seq: Seq, need_blocks: int, plan: StepPlan) -> None:
        """Take a sequence in: its HBM prefix hit, then what the shared tier adds (loaded this step)."""
        request = seq.request
        cap = hit_cap_tokens(request.prompt_tokens, self.hbm.unit_tokens)
        hbm_hit = min(self.hbm.match_units(request, touch=True) * self.hbm.unit_tokens, cap)
        external = self.backend.external_hit_tokens(self.server, request)
        seq.hbm_hit_tokens = hbm_hit
        seq.computed_tokens = max(hbm_hit, external)
        if external > hbm_hit:
            seq.loaded_tokens = external - hbm_hit
            plan.loads.append((seq, hbm_hit, external))
        self.hbm.pin(request)
        self.hbm.store(request, seq.computed_tokens)
        self.reserved_blocks += need_blocks
        self.running.append(seq)

    # ------------------------------------------------------------------------------------------ execute

    def _load(self, plan: StepPlan, index: int) -> None:
        if index == len(plan.loads):
            self._compute(plan)
            return
        seq, start, stop = plan.loads[index]
        started_s = self.loop.now

        def loaded() -> None:
            seq.load_s += self.loop.now - started_s
            self._load(plan, index + 1)

        self.backend.load(self.server, self.slot, seq.request, start, stop, loaded)

    def _compute(self, plan: StepPlan) -> None:
        prefill = [(s.computed_tokens, n) for s, n in plan.pieces if s.is_prefilling]
        decode = [s.num_tokens for s, _ in plan.pieces if not s.is_prefilling]
        self.loop.after(self.step_model.step_s(prefill, decode), self._computed, plan)

    def _computed(self, plan: StepPlan) -> None:
        for seq, new in plan.pieces:
            if seq.is_prefilling:
                seq.computed_tokens += new
                self.hbm.store(seq.request, seq.computed_tokens)
                plan.saves.append(seq)
        self._save(plan, 0)

    def _save(self, plan: StepPlan, index: int) -> None:
        if index == len(plan.saves):
            self._apply(plan)
            return
        seq = plan.saves[index]
        done = partial(self._save, plan, index + 1)
        self.backend.save(self.server, self.slot, seq.request, seq.computed_tokens, done)

    # ------------------------------------------------------------------------------------------ apply

    def _apply(self, plan: StepPlan) -> None:
        now = self.loop.now
        prefilled = {id(s) for s in plan.saves}
        finished: list[Seq] = []
        for seq, _ in plan.pieces:
            if id(seq) in prefilled:
                if seq.is_prefilling:
                    continue
                seq.first_token_s = now  # the step that computes the last prompt token samples the first
            seq.output_tokens += 1
            if seq.output_tokens >= seq.request.output_tokens:
                finished.append(seq)
        for seq in finished:
            self._finish(seq, now)
        self._step()

    def _finish(self, seq: Seq, now: float) -> None:
        self.running.remove(seq)
        self.hbm.unpin(seq.request)
        self.reserved_blocks -= self._blocks_of(seq.request)
        seq.finish_s = now
        seq.on_finished(seq)

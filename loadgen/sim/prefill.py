"""Simulated prefill engines (PEs) and the groups that step them.

A PE holds the requests placed on it (`num_unfinished` / `unfinished_tokens`, what its load report would
say) and a FIFO of prefill work whose hit KV is already in a DRAM buffer. Each step it packs its batch with
the engine's own planner, `plan_prefill_batch` under the compute quota, predicting attention time with an
`AttentionProfile` fitted in advance (`fit_attention_profile` over the model's true per-layer attention
times, as the paper profiles offline; the DSA top-k term is outside the planner's FLOP model, so predictions
are close but not exact, as on real hardware). Non-layerwise prefill (Basic) must also hold every layer's KV
of the batch in HBM, so only the FIFO prefix that fits `pe_kv_bytes` is offered to the planner.
A group is the PEs that step together: a node's PEs for an expert-parallel model, else one PE.
"""

from __future__ import annotations

from collections.abc import Callable

from loadgen.sim.config import SimSetup
from loadgen.sim.events import EventLoop
from loadgen.sim.models import SimModel
from loadgen.sim.pipeline import RankBatch, StepTiming, rank_attention_s, step_timing
from loadgen.sim.requests import SimRequest
from services.policy.batching import (
    AttentionProfile,
    AttentionSample,
    BatchingLimits,
    PrefillWork,
    fit_attention_profile,
    plan_prefill_batch,
)
from services.policy.quota import RateMeter
from services.policy.short_first import (
    PrefillQueue,
    WaitingPrefill,
    num_passing,
    postponements,
    short_first_order,
)
from services.policy.snapshot import ReadSide

EMPTY_RANK = RankBatch((), 0.0, 0.0)
_PROFILE_CONTEXTS = (0, 1024, 4096, 16384, 32768, 65536)
_PROFILE_NEW_TOKENS = (16, 64, 256, 1024, 4096)


def profile_attention(model: SimModel) -> AttentionProfile:
    """The planner's attention profile, fitted once over single-request batches of a grid of shapes."""
    samples = [
        AttentionSample(((cached, new),), rank_attention_s(model, ((cached, new),)))
        for cached in _PROFILE_CONTEXTS
        for new in _PROFILE_NEW_TOKENS
    ]
    prior = AttentionProfile(s_per_flop=1.0 / model.attention_flops_per_s)
    return fit_attention_profile(samples, model.attention_shape, prior)


class Work:
    """Prefill still to do: `cached` tokens have KV (hit or earlier chunks), `remaining` to compute."""

    __slots__ = ("cached", "is_first_chunk", "postponed", "remaining", "request", "total")

    def __init__(self, request: SimRequest, cached: int, remaining: int) -> None:
        self.request = request
        self.cached = cached
        self.remaining = remaining
        self.total = remaining
        self.is_first_chunk = True
        self.postponed = 0  # short-first: compute started ahead of it

    def waiting(self) -> WaitingPrefill:
        return WaitingPrefill(self.remaining, self.total, self.postponed)


class PrefillEngine:
    __slots__ = (
        "assigned",
        "compute_rate",
        "engine_id",
        "index",
        "is_counting_prompt",
        "is_short_first",
        "kv_cap_tokens",
        "limits",
        "model",
        "node",
        "num_unfinished",
        "prefill_rate",
        "profile",
        "queue",
        "unfinished_tokens",
    )

    def __init__(
        self, engine_id: str, node: int, index: int, setup: SimSetup, profile: AttentionProfile
    ) -> None:
        model, config = setup.model, setup.config
        self.engine_id = engine_id
        self.node = node
        self.index = index
        self.model = model
        self.profile = profile
        self.limits = BatchingLimits(config.compute_quota_s, config.max_batch_tokens)
        self.kv_cap_tokens = 0 if setup.is_layerwise else int(model.pe_kv_bytes // model.kv_bytes_per_token)
        self.is_counting_prompt = config.beta_rate == "prompt"
        self.queue: list[Work] = []
        self.num_unfinished = 0
        self.unfinished_tokens = 0
        self.prefill_rate = RateMeter()  # prompt (or computed) tokens per busy second, as a live PE
        self.compute_rate = RateMeter()  # computed tokens per busy second
        self.is_short_first = config.prefill_order == "short-first"
        self.assigned: dict[str, int] = {}  # short-first: placed, unfinished requests -> tokens to compute

    def assign(self, request: SimRequest) -> None:
        self.num_unfinished += 1
        self.unfinished_tokens += request.prompt_tokens
        if self.is_short_first:
            self.assigned[request.request_id] = request.prompt_tokens - request.read_tokens

    def release(self, request: SimRequest) -> None:
        self.num_unfinished -= 1
        self.unfinished_tokens -= request.prompt_tokens
        self.assigned.pop(request.request_id, None)

    def prefill_queue(self, beta_s: float) -> PrefillQueue | None:
        """Under short-first, the queue as a live PE's load report lists it (its placed, unfinished
        prefills by tokens left: those still reading their hit, as placed), for the router's past-beta
        placement; None under first come, first served or before a compute rate is measured."""
        limit = beta_s * self.compute_rate.value
        if not self.is_short_first or limit <= 0:
            return None
        queued = {w.request.request_id: w.remaining for w in self.queue}
        left = sorted(queued.get(rid, tokens) for rid, tokens in self.assigned.items())
        return PrefillQueue(left, len(left), limit)

    def add_work(self, request: SimRequest) -> None:
        cached = request.read_tokens
        self.queue.append(Work(request, cached, request.prompt_tokens - cached))

    def plan(self) -> list[tuple[Work, int]]:
        """This step's batch: (work, tokens to compute now), a FIFO prefix of the queue."""
        if not self.queue:
            return []
        offered = self.queue
        if self.kv_cap_tokens:
            offered, tokens = [], 0
            for work in self.queue:
                tokens += work.cached + work.remaining
                if offered and tokens > self.kv_cap_tokens:
                    break
                offered.append(work)
        if self.is_short_first:
            offered = short_first_offer(offered)
        queue = [PrefillWork(w.request.request_id, w.cached, w.remaining) for w in offered]
        plan = plan_prefill_batch(queue, self.profile, self.model.attention_shape, self.limits)
        batch = []
        for work, item in zip(offered, plan.items, strict=False):
            assert item.request_id == work.request.request_id, "the planner keeps the offered order"
            batch.append((work, item.new_tokens))
        if self.is_short_first:  # what the batch passed (the queue is in arrival order)
            index = {id(w): i for i, w in enumerate(self.queue)}
            placed = [index[id(w)] for w, _ in batch]
            for w, added in zip(
                self.queue, postponements([w.waiting() for w in self.queue], placed), strict=True
            ):
                w.postponed += added
        return batch

    def rank_batch(self, batch: list[tuple[Work, int]], kv_bytes_per_layer_token: float) -> RankBatch:
        if not batch:
            return EMPTY_RANK
        loopback = network = 0.0
        for work, _ in batch:
            layer_bytes = work.cached * kv_bytes_per_layer_token
            if work.request.read_side is ReadSide.DE:
                network += layer_bytes
            else:
                loopback += layer_bytes
        return RankBatch(tuple((w.cached, n) for w, n in batch), loopback, network)

    def complete(self, batch: list[tuple[Work, int]], duration_s: float) -> list[SimRequest]:
        """Apply a finished step: advance the chunks, update the measured rate; return finished requests."""
        if not batch:
            return []
        units = computed = 0
        done: list[SimRequest] = []
        for work, new_tokens in batch:
            computed += new_tokens
            units += new_tokens + (work.cached if self.is_counting_prompt and work.is_first_chunk else 0)
            work.cached += new_tokens
            work.remaining -= new_tokens
            work.is_first_chunk = False
            if work.remaining <= 0:
                done.append(work.request)
        if self.is_short_first:
            self.queue = [w for w in self.queue if w.remaining > 0]
        else:
            del self.queue[: len(done)]  # finished work is a FIFO prefix (only the last item may be chunked)
        self.prefill_rate.add(units, duration_s)
        self.compute_rate.add(computed, duration_s)
        return done


def short_first_offer(queue: list[Work]) -> list[Work]:
    """A short-first PE's queue as its planner packs it (the engine's scheduler): the waiting works
    shortest first, those that may pass every partly prefilled one (`num_passing`) ahead of them, the rest
    after."""
    partials = [w for w in queue if not w.is_first_chunk]
    waiting = [w for w in queue if w.is_first_chunk]
    waiting = [waiting[i] for i in short_first_order([w.waiting() for w in waiting])]
    ahead = num_passing([w.waiting() for w in waiting], [w.waiting() for w in partials])
    return waiting[:ahead] + partials + waiting[ahead:]


class PrefillGroup:
    """PEs that step together; a step starts when the group is idle and any of them has work."""

    __slots__ = ("_loop", "_on_prefilled", "_on_step", "_setup", "engines", "is_busy", "num_steps")

    def __init__(
        self,
        loop: EventLoop,
        engines: list[PrefillEngine],
        setup: SimSetup,
        on_prefilled: Callable[[SimRequest], None],
        on_step: Callable[[StepTiming], None],
    ) -> None:
        self._loop = loop
        self.engines = engines
        self._setup = setup
        self._on_prefilled = on_prefilled
        self._on_step = on_step
        self.is_busy = False
        self.num_steps = 0

    def kick(self) -> None:
        if not self.is_busy and any(e.queue for e in self.engines):
            self._start_step()

    def _start_step(self) -> None:
        setup = self._setup
        batches = [e.plan() for e in self.engines]
        per_layer = setup.model.kv_bytes_per_layer_token
        timing = step_timing(
            setup.model,
            [e.rank_batch(b, per_layer) for e, b in zip(self.engines, batches, strict=True)],
            is_layerwise=setup.is_layerwise,
            loopback_bytes_per_s=setup.kv_copy_bytes_per_s,
            network_bytes_per_s=setup.net_bytes_per_s,
        )
        self.is_busy = True
        self.num_steps += 1
        self._loop.after(timing.duration_s, self._finish_step, batches, timing)

    def _finish_step(self, batches: list[list[tuple[Work, int]]], timing: StepTiming) -> None:
        self.is_busy = False
        self._on_step(timing)
        done: list[SimRequest] = []
        for engine, batch in zip(self.engines, batches, strict=True):
            done += engine.complete(batch, timing.duration_s)
        for request in done:
            self._on_prefilled(request)
        self.kick()

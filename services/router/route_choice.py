"""Move the query, router side: which primitive serves a request whose prompt starts with a held chunk.

The index names the chunks engines hold (location `held:<engine>`, one bit per holder); a request sent to
engine E whose prompt shares n leading blocks with a chunk that a live engine H != E holds is a candidate.
`HeldRouting.apply` prices route, fetch and local for it with the pure cost model
(`services/policy/movequery.py`: the model's shape and the holder's queue from the engines' load reports,
the fabric constants from a calibrated profile or the uncalibrated fallback) and writes the choice into
the plan as a `HeldPrefix`; the engine does the rest (`services/engine/route.py`). Mode `auto` takes the
argmin; `route`, `fetch` and `local` force one primitive wherever it is possible (benchmarks and tests: the
holder itself is then not picked while another engine can take the request, so every candidate uses it).
A request naming a chunk (`plan.pin`, the `kv_chunk` extension) is the chunk's source, never a candidate: it
goes to an engine holding its whole prompt prefix, else to the engine its name went to last, else to any
engine that holds chunks; that engine keeps the prompt under the name (`services/engine/route.py`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from services.policy.movequery import (
    CostProfile,
    Fabric,
    ModelShape,
    Primitive,
    RouteRequest,
    can_take_chunk,
    choose,
    fetch_s,
    local_attention_s,
    local_s,
    memory_wait_s,
    request_costs,
    resident_kv_tokens,
    route_exchange_s,
)
from services.policy.movequery_profile import fallback_profile, profile_from_dict
from services.router import metrics
from services.router.engines import EngineTable
from services.router.kv_plan import Undecided
from shared.blocks import max_hit_blocks
from shared.errors import ConfigError, NoEngineAvailableError
from shared.protocol import RouteCapability
from shared.protocol.movequery import HELD_TIER, HeldPrefix
from shared.protocol.tasks import RequestPlan

log = logging.getLogger(__name__)

MODES = ("", "auto", "route", "fetch", "local")
MAX_NAMES = 4096  # (tenant, chunk name) -> the engine a naming request went to, most recent kept
# a request planned this long ago and still undecided failed before its dispatch (lookups time out sooner)
UNDECIDED_MAX_AGE_S = 5.0


def load_profile(path: str) -> CostProfile | None:
    """The calibrated profile file (`kvpath bench movequery --calibrate`); None: none configured."""
    if not path:
        return None
    try:
        return profile_from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read move-the-query profile {path}: {exc}", param="movequery_profile"
        ) from None


class HeldRouting:
    def __init__(self, engines: EngineTable, *, mode: str, profile: CostProfile | None, fabric: str) -> None:
        if mode not in MODES[1:]:
            raise ConfigError(f"move_query mode {mode!r} is not one of {', '.join(MODES[1:])}")
        self.engines = engines
        self.mode = mode
        self.profile = profile
        self.fabric = fabric
        self.names: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.undecided = Undecided(UNDECIDED_MAX_AGE_S)  # the router's KvPlanner adds, `apply` removes
        # holder -> (the seq of its last report, requests routed to it since): a burst's routes on it
        self.routed: dict[str, tuple[int, int]] = {}

    def holders(self, locality: Mapping[str, int]) -> dict[str, int]:
        """Live engines holding a leading chunk of this prompt -> how many blocks of it."""
        out = {}
        for location, n in locality.items():
            tier, _, engine_id = location.partition(":")
            state = self.engines.get(engine_id) if tier == HELD_TIER and n > 0 else None
            if state is not None and state.report.route is not None and not state.report.is_draining:
                out[engine_id] = n
        return out

    def avoid(self, locality: Mapping[str, int], plan: RequestPlan | None = None) -> set[str]:
        """Engines not to pick for this request while another can take it. A forced mode: the holders, so
        every candidate uses the forced primitive. `auto` may serve a request on the holder itself (which
        copies the chunk into the request's blocks), unless the holder's free KV cannot take it or the
        holder shares its compute with other engines (`shares_compute`)."""
        if plan is not None and plan.pin is not None:
            return self._not_for_pin(plan, locality)
        if self.mode != "auto":
            return set(self.holders(locality))
        if plan is None:
            return set()
        need = plan.num_prompt_tokens + plan.sampling.max_tokens
        holders = self.holders(locality)
        return {h for h in holders if self.free_kv_tokens(h) < need or self.shares_compute(h)}

    def shares_compute(self, engine_id: str) -> bool:
        """Whether another live engine computes on what this one does (its load report's `compute_id`: CPU
        engines of one host, engines on one GPU). A holder's idle compute is then not spare: a request served
        there slows the engines it shares with and queues the route exchanges the holder serves, to save a
        fetch of milliseconds (measured: README, the fan-in with default caches)."""
        state = self.engines.get(engine_id)
        mine = state.report.compute_id if state is not None else ""
        live = self.engines.live(time.monotonic())
        return bool(mine) and any(
            s.report.compute_id == mine and s.report.service_id != engine_id for s in live
        )

    def _not_for_pin(self, plan: RequestPlan, locality: Mapping[str, int]) -> set[str]:
        """The engines a request naming a chunk should not go to: all but the preferred ones (holders of
        its whole prefix, else the engine its name went to, else any engine that may hold chunks)."""
        assert plan.pin is not None
        live = {s.report.service_id: s.report for s in self.engines.live(time.monotonic())}
        can_hold = {e for e, r in live.items() if r.route is not None and r.route.hold_budget_blocks > 0}
        full = max_hit_blocks(plan.num_prompt_tokens, self._block_size())
        holding = {h for h, n in self.holders(locality).items() if n >= full > 0}
        named = {self.names.get((plan.pin.tenant, plan.pin.name), "")}
        if not can_hold:
            raise NoEngineAvailableError(
                "no live engine holds chunks (--hold-bytes): 'kv_chunk' cannot be kept"
            )
        for preferred in (holding & can_hold, named & can_hold):
            if preferred:
                return set(live) - preferred
        return set(live) - can_hold

    def _block_size(self) -> int:
        return self.engines.kv_format.block_size if self.engines.kv_format else 1

    def free_kv_tokens(self, engine_id: str) -> int:
        """The engine's free KV after the work queued on it: the report's free blocks less what the router
        sent since and what the engine's queued requests will need (`waiting_kv_tokens`). Negative when that
        work exceeds the free KV (a backlog, which the cost model reads as such)."""
        state = self.engines.get(engine_id)
        if state is None:
            return 0
        report = state.report
        free = report.free_kv_blocks * self._block_size() - state.pending_kv_tokens
        return free - report.waiting_kv_tokens

    def kv_release(self, engine_id: str) -> tuple[tuple[float, int], ...]:
        """When the engine's requests give KV back (seconds from now, tokens), soonest first: its running
        ones from its last load report less the report's age, and those this router sent it since, when
        it priced them (a burst's earlier copies, which the next ones wait for)."""
        state = self.engines.get(engine_id)
        if state is None:
            return ()
        report = state.report
        age = max(0.0, time.time() - report.sent_at)
        now = time.monotonic()
        reported = zip(report.kv_release_s, report.kv_release_tokens, strict=True)
        return tuple(
            sorted(
                [(max(0.0, at - age), n) for at, n in reported]
                + [(max(0.0, at - now), n) for at, n in state.pending_kv_release]
            )
        )

    def apply(
        self, plan: RequestPlan, engine_id: str, locality: Mapping[str, int], chosen: str | None = None
    ) -> None:
        """Set `plan.kv.held` for the engine the request goes to (cleared when nothing is held elsewhere) and
        count the KV the choice keeps there, so the requests dispatched before its next report see it.
        `chosen`: the primitive the dispatch's policy already chose with the engine (`--policy auto` prices
        route, fetch and local in its own plans), else this mode's rule decides."""
        self.undecided.discard(plan.request_id)
        plan.kv.held = None
        if plan.pin is not None:  # the chunk's source: computed or loaded here, then kept under the name
            key = (plan.pin.tenant, plan.pin.name)
            self.names[key] = engine_id
            self.names.move_to_end(key)
            while len(self.names) > MAX_NAMES:
                self.names.popitem(last=False)
            return
        requester = self.engines.get(engine_id)
        holders = {h: n for h, n in self.holders(locality).items() if h != engine_id}
        if not holders or requester is None or requester.report.route is None:
            return
        holder_id, n = max(holders.items(), key=lambda item: item[1])
        block_size = self._block_size()
        n = min(n, max_hit_blocks(plan.num_prompt_tokens, block_size))
        holder = self.engines.get(holder_id)
        assert holder is not None and holder.report.route is not None  # `holders` keeps only such engines
        route = holder.report.route
        shape = model_shape(route)
        if n <= 0:
            return
        num_store = min(n, locality.get("store", 0))
        profile = self.profile or fallback_profile(shape)
        request = self._request(plan, engine_id, holder_id, n, locality, profile)
        request = replace(request, can_fetch=num_store >= n)
        primitive = self._primitive(profile, request, chosen)
        log.debug("move the query request_id=%s %s: %s", plan.request_id, primitive, request)
        plan.kv.held = self._held(plan, holder_id, n, num_store, primitive, shape, can_take_chunk(request))
        if primitive is Primitive.ROUTE:
            self.routed[holder_id] = (holder.report.seq, self._routed_since_report(holder_id) + 1)
        kept = resident_kv_tokens(primitive, request)
        self.engines.note_kv_reserved(engine_id, kept, self._release_in_s(profile, request, primitive))
        metrics.MOVEQUERY_CHOICES.labels(str(primitive)).inc()

    def _request(
        self,
        plan: RequestPlan,
        engine_id: str,
        holder_id: str,
        n: int,
        locality: Mapping[str, int],
        profile: CostProfile,
    ) -> RouteRequest:
        """The (request, chunk of `n` blocks) pair as the cost model sees it on this requester: its memory
        and when it frees, the holder's queue or what routed steps measured here, and the burst."""
        requester, holder = self.engines.get(engine_id), self.engines.get(holder_id)
        assert requester is not None and requester.report.route is not None
        assert holder is not None and holder.report.route is not None
        measured = requester.report.route
        chunk = n * self._block_size()
        delay_s = measured_delay_s(profile, profile.fabric(self.fabric), measured, chunk)
        return RouteRequest(
            chunk_tokens=chunk,
            new_tokens=plan.num_prompt_tokens - chunk,
            decode_steps=plan.sampling.max_tokens,
            free_kv_tokens=self.free_kv_tokens(engine_id),
            kv_release=self.kv_release(engine_id),
            holder_queue_s=max(holder.report.route.holder_queue_s, delay_s),
            pending_requests=self.burst_share(plan, n, locality),
            holder_burst=self.undecided.sharing(plan.request_id, plan.kv.block_hashes, n)
            + self._routed_since_report(holder_id),
            kv_capacity_tokens=requester.report.total_kv_blocks * self._block_size(),
            # its step besides the route exchanges (the model prices those), which a routed batch's includes
            decode_step_s=max(0.0, requester.report.decode_step_s - measured.route_step_s),
        )

    def burst_share(self, plan: RequestPlan, num_blocks: int, locality: Mapping[str, int]) -> int:
        """This requester's share of the burst: the other requests sharing the chunk's `num_blocks` that are
        still undecided (counted in `kvpath_router_movequery_burst_size`), over the engines that may take
        them (the pick spreads a burst by load)."""
        others = self.undecided.sharing(plan.request_id, plan.kv.block_hashes, num_blocks)
        metrics.MOVEQUERY_BURST.observe(others)
        if not others:
            return 0
        avoid = self.avoid(locality, plan)
        takers = [
            s
            for s in self.engines.live(time.monotonic())
            if s.report.route is not None and not s.report.is_draining and s.report.service_id not in avoid
        ]
        return others // max(1, len(takers))

    def _routed_since_report(self, holder_id: str) -> int:
        """Requests this router routed to the holder since its last load report (its queue says the rest)."""
        holder = self.engines.get(holder_id)
        seq, n = self.routed.get(holder_id, (-1, 0))
        return n if holder is not None and holder.report.seq == seq else 0

    def _release_in_s(self, profile: CostProfile, request: RouteRequest, primitive: Primitive) -> float:
        """In how many seconds the request gives its KV on the requester back, as priced: its own wait for
        that memory, the primitive's time and its decode steps (inf: not known)."""
        start_s = memory_wait_s(request, resident_kv_tokens(primitive, request))
        bare = replace(request, free_kv_tokens=None)  # its time once admitted
        total, _ = request_costs(profile, profile.fabric(self.fabric), bare)
        return start_s + total[str(primitive)] + request.decode_steps * request.decode_step_s

    def route_profile(self) -> CostProfile | None:
        """The route constants a cost model prices with: the calibrated profile, else the uncalibrated guess
        for the served model's shape (None until an engine that speaks the protocol reported)."""
        if self.profile is not None:
            return self.profile
        for state in self.engines.live(time.monotonic()):
            if state.report.route is not None:
                return fallback_profile(model_shape(state.report.route))
        return None

    def _primitive(self, profile: CostProfile, request: RouteRequest, chosen: str | None) -> Primitive:
        if self.mode != "auto":
            primitive = Primitive(self.mode)
        elif chosen is not None:
            primitive = Primitive(chosen)
        else:
            primitive = choose(profile, profile.fabric(self.fabric), request).primitive
        return Primitive.LOCAL if primitive is Primitive.FETCH and not request.can_fetch else primitive

    def _held(
        self,
        plan: RequestPlan,
        holder_id: str,
        n: int,
        num_store: int,
        primitive: Primitive,
        shape: ModelShape,
        room: bool,
    ) -> HeldPrefix:
        """The plan's move-the-query part; the hit blocks set for the primitive. `room`: the requester can
        take a copy of the chunk (`can_take_chunk`); a request routed without it is never repriced into
        taking one between decode steps (the copy would take the memory routing left to the others)."""
        profile = self.profile or fallback_profile(shape)
        chunk = n * self._block_size()
        take = local_s(profile, chunk)
        if num_store >= n:
            take = min(take, fetch_s(profile, chunk))
        if self.mode != "auto" or not room:
            take = 0.0  # a forced primitive is never repriced between decode steps
        if primitive is Primitive.LOCAL:
            plan.kv.num_hit_blocks = 0  # recompute the chunk here
        elif primitive is Primitive.FETCH:
            plan.kv.num_hit_blocks = min(plan.kv.num_hit_blocks, num_store)
        return HeldPrefix(
            holder_id=holder_id,
            num_blocks=n,
            primitive=str(primitive),
            fallback="fetch" if num_store >= n else "local",
            num_store_blocks=num_store,
            take_s=take,
            local_step_s=shape.num_layers * local_attention_s(profile, shape.rows_per_token, chunk),
        )


def measured_delay_s(profile: CostProfile, fabric: Fabric, requester: RouteCapability, chunk: int) -> float:
    """What the requester's routed decoding steps measured (`route_step_s`, its recent ones) cost per exchange
    beyond the model's price of one, 0 when none was measured lately: the round trip's real cost on this
    host under its load (on a few shared cores a round trip waits for the holder's and the requester's
    turns on a core, which a calibration in one idle process does not see). The router prices it as a
    queue on every exchange, as it does the holder's own."""
    if requester.route_step_s <= 0:
        return 0.0
    shape = profile.shape
    model_s = route_exchange_s(profile, fabric, shape.rows_per_token, chunk)
    return max(0.0, requester.route_step_s / shape.num_layers - model_s)


def model_shape(route: RouteCapability) -> ModelShape:
    """The served model's shape as an engine's load report states it."""
    return ModelShape(
        route.num_layers,
        route.rows_per_token,
        route.query_bytes_per_row,
        route.partial_bytes_per_row,
        route.kv_bytes_per_token_layer,
    )

"""`--policy auto`: one cost model (`services/policy/auto.py`) picks each request's engine(s), and with them
the path its hit KV takes; every decision is explained. What a colocated topology offers, and so what auto
chooses among there: the prefix resident in an engine's own cache (`hbm:` / `dram:<engine>` in the index's
answer; both count as the `hbm` source and are priced as free to reach, though a local DRAM cache is a
memory copy away), the shared pool (`cxl:<pool>`, `--kv-tier pool`), storage read on the engine's node, or
recomputing it. The engine, not the router, loads from the best tier it has, so the plan's source is auto's
prediction of what the chosen engine will do (the cheaper source on an engine is always the one it takes).
With `--move-query auto` a chunk held by an engine (`held:<engine>`) is two more sources: resident on its
holder (the holder copies it into the request), and `route` (the query rows go to the holder) on every
other engine, priced with the move-the-query profile; auto's plan then sets the primitive `route_choice.py`
writes into the request (route, fetch for a hit read from a tier, local for recompute). A forced
`--move-query route|fetch|local` still decides after auto picked the engine.
On prefill/decode engines the plans are theirs (remote prefill on a PE with the history from the pool,
storage on either node or the decode engine's cache, local prefill on a session decode engine, recompute:
`--auto-decode-engines` says which) and `auto_pd.py` executes the chosen one.

Queues: the router keeps a ledger of its own predictions (prefilling engine -> request -> predicted
first-token time) and prices an engine's queue as the latest of those still open; running decodes and
context from the load reports. What the model leaves out (dispatch, bus, first-token delivery), how much
slower than profiled the machine runs now, and the paths it still prices off are learned online from the
measured TTFTs (`services/policy/auto_calibration.py`). Explained: `kvpath_router_plan_total{plan}`, an
`auto_plan` span per request from dispatch to first token (plan, engines, predicted TTFT, the path's factor,
harm, runner-up, measured TTFT), `kvpath_router_plan_ttft_error_seconds`; a debug log line per request.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.policy.ampd_costs import CostModel
from services.policy.auto import AUTO, AutoRequest, AutoSnapshot, Decision, EngineLoad, Plan, Source, plan
from services.policy.auto_calibration import PathCorrection, TtftCalibration
from services.policy.auto_costs import DEFAULT_MAX_NUM_BATCHED_TOKENS, POOL, AutoProfiles
from services.policy.snapshot import ROLE_COLOCATED, EngineSnapshot
from services.router import metrics
from services.router.auto_pd import PD_PATHS, SESSION_DECODE, dispatch_pd, has_pd_engines
from services.router.config import RouterConfig
from services.router.dispatch import ColocatedDispatch, local_blocks
from services.router.engines import EngineTable
from services.router.measured_costs import measured_cost_model
from services.router.plan_ledger import PlanLedger
from services.router.streams import StreamTable
from shared import telemetry
from shared.bus import Bus
from shared.protocol import LoadReport, RequestPlan, TokenBatch

log = logging.getLogger(__name__)

__all__ = ["AUTO", "AutoDispatch", "PlanLedger", "build_auto_dispatch"]

LIVE_SOURCES = frozenset({Source.HBM, Source.POOL, Source.STORAGE, Source.RECOMPUTE})
OUTPUT_HORIZON = 256  # output tokens a decision looks ahead (max_tokens is only an upper bound)


@dataclass(slots=True)
class _Open:
    decision: Decision
    dispatched_at: float
    span: Any
    raw_ttft_s: float  # the prediction before calibration
    base_ttft_s: float  # calibrated, before its path's factor
    task_id: str  # the id the engines know the request by (a retried dispatch's own)


class AutoDispatch(ColocatedDispatch):
    def __init__(
        self,
        engines: EngineTable,
        bus: Bus,
        router_id: str,
        ack_timeout_s: float,
        *,
        cost_profile: str = "",
        kv_link: str = "shm",
        decode_engines: str = SESSION_DECODE,
    ) -> None:
        super().__init__(engines, bus, router_id, ack_timeout_s, policy=AUTO)
        self.pd_sources, self.local_on_decode = PD_PATHS[decode_engines]
        profiled = json.loads(Path(cost_profile).read_text()) if cost_profile else None
        self.profiled = CostModel.from_dict(profiled) if profiled is not None else None
        self.kv_link = kv_link
        self.ledger = PlanLedger()
        self.calibration = TtftCalibration()  # learned: overhead outside the model, the machine's speed now
        self.paths = PathCorrection()  # learned: the paths the calibrated profile still prices off
        self._picked: dict[str, Decision] = {}
        self._reserved: dict[str, str] = {}  # request -> prefill engine, decided and not yet sent
        self._open: dict[str, _Open] = {}
        self._engines_of: dict[str, tuple[str, str]] = {}  # request -> (prefill, decode) until it leaves
        self._request_of: dict[str, str] = {}  # a retried dispatch's id for the engines -> its request

    # ------------------------------------------------------------------------------------------ decide

    def _pick(
        self, engines: list[EngineSnapshot], plan_: RequestPlan, locality: Mapping[str, int]
    ) -> str | None:
        decision = self._decide_reserving(plan_.request_id, engines, plan_, locality)
        if decision is None:
            return None
        self._picked[plan_.request_id] = decision
        return decision.chosen.decode_engine

    def _decide_reserving(
        self, request_id: str, engines: list[EngineSnapshot], plan_: RequestPlan, locality: Mapping[str, int]
    ) -> Decision | None:
        """Decide, and put the plan in the ledger at once: requests decided while this one is still being
        sent (a burst, all decided before the first ack) see its engine busy, else they all pick the engine
        that looked cheapest to the first. A later decision for the same request (a retry) replaces it."""
        self._unreserve(request_id)
        decision = self.decide(engines, plan_, locality)
        if decision is not None:
            chosen = decision.chosen
            self.ledger.add(chosen.prefill_engine, request_id, time.monotonic() + self._model_s(chosen))
            self._reserved[request_id] = chosen.prefill_engine
        return decision

    def _unreserve(self, request_id: str) -> None:
        engine_id = self._reserved.pop(request_id, None)
        if engine_id is not None:
            self.ledger.drop(engine_id, request_id)

    def _model_s(self, chosen: Plan) -> float:
        """The chosen plan's predicted TTFT less the learned fixed overhead: its engine's time on it."""
        cal = self.calibration
        return max(0.0, chosen.ttft_s - cal.overhead_s)

    def decide(
        self, engines: list[EngineSnapshot], plan_: RequestPlan, locality: Mapping[str, int]
    ) -> Decision | None:
        """Auto's plan over `engines`: colocated ones, or prefill and decode engines (`auto_pd.py`)."""
        return plan(
            self._request(engines, plan_, locality), self._snapshot(engines, locality), self.profiles()
        )

    def _request(
        self, engines: list[EngineSnapshot], p: RequestPlan, locality: Mapping[str, int]
    ) -> AutoRequest:
        bs = self.block_size()
        stored = bs * min(p.kv.num_hit_blocks, locality.get("store", p.kv.num_hit_blocks))
        pooled = bs * max((n for loc, n in locality.items() if loc.startswith("cxl:")), default=0)
        resident = {e.engine_id: bs * local_blocks(locality, e.engine_id) for e in engines}
        held = {h: bs * n for h, n in self._held_blocks(p, locality).items()}
        for holder, tokens in held.items():  # a holder copies its chunk into the request: resident there
            resident[holder] = max(resident.get(holder, 0), tokens)
        return AutoRequest(
            p.request_id,
            p.num_prompt_tokens,
            min(p.sampling.max_tokens, OUTPUT_HORIZON),
            min(stored, p.num_prompt_tokens),
            min(pooled, p.num_prompt_tokens),
            {k: min(v, p.num_prompt_tokens) for k, v in resident.items() if v},
            {k: min(v, p.num_prompt_tokens) for k, v in held.items()},
            p.ttft_slo_s or None,
        )

    def _held_blocks(self, p: RequestPlan, locality: Mapping[str, int]) -> dict[str, int]:
        """Live holders of a leading chunk of the prompt -> its blocks, when auto prices move the query (its
        `--move-query auto`; a forced mode stays with `HeldRouting`); none for a request naming a chunk."""
        if self.held_routing is None or self.held_routing.mode != AUTO or p.pin is not None:
            return {}
        return dict(self.held_routing.holders(locality))

    def held_primitive(self, plan_: RequestPlan) -> str | None:
        """The move-the-query primitive of auto's plan for the engine it picked: `route` when it routes the
        query, `local` when it recomputes, else `fetch` (the hit comes from a tier, not the holder)."""
        decision = self._picked.get(plan_.request_id)
        if decision is None or self.held_routing is None or self.held_routing.mode != AUTO:
            return None
        source = decision.chosen.source
        return "route" if source is Source.ROUTE else "local" if source is Source.RECOMPUTE else "fetch"

    def _snapshot(self, engines: list[EngineSnapshot], locality: Mapping[str, int]) -> AutoSnapshot:
        now = time.monotonic()
        loads = []
        for e in engines:
            state = self.engines.get(e.engine_id)
            reported = state.report.num_running if state is not None else 0
            running = max(reported, self.ledger.num_decoding(e.engine_id))
            busy = self.ledger.busy_s(e.engine_id, now)
            loads.append(
                EngineLoad(
                    e.engine_id,
                    e.role,
                    e.node,
                    0,
                    busy,
                    running,
                    e.unfinished_tokens,
                    is_draining=e.is_draining,
                    max_num_batched_tokens=_budget(state.report if state is not None else None),
                )
            )
        _, nodes = self.engines.cluster_snapshot(self.block_size())
        reads = {n.node: n.read_queue_tokens for n in nodes if n.is_storage_alive}
        has_pool = any(loc.startswith("cxl:") for loc in locality)  # a pool holds some of the prompt
        if any(e.role != ROLE_COLOCATED for e in engines):  # the paths of the P/D engines
            pool_queue = 0 if has_pool else None
            return AutoSnapshot(tuple(loads), reads, pool_queue, self.pd_sources, self.local_on_decode)
        routes = self.held_routing is not None and self.held_routing.mode == AUTO
        sources = LIVE_SOURCES | {Source.ROUTE} if routes else LIVE_SOURCES
        return AutoSnapshot(tuple(loads), reads, 0 if has_pool else None, sources)

    def profiles(self) -> AutoProfiles:
        costs = self.profiled or self._measured_costs()
        pool_link = POOL if POOL in costs.links else self.kv_link  # the pool is read like host memory
        cal = self.calibration
        routing = self.held_routing
        return AutoProfiles(
            costs,
            data_link=self.kv_link,
            pool_link=pool_link,
            route=routing.route_profile() if routing is not None and routing.mode == AUTO else None,
            route_fabric=routing.fabric if routing is not None else self.kv_link,
            overhead_s=cal.overhead_s,
            time_scale=cal.scale,
            path_scale=self.paths.factors,
        )

    def _measured_costs(self) -> CostModel:
        """A linear model from the engines' measured rates, until a `kvpath profile` file is given."""
        return measured_cost_model(self.engines, data_link=self.kv_link)

    def block_size(self) -> int:
        return self.engines.kv_format.block_size if self.engines.kv_format is not None else 1

    # ----------------------------------------------------------------------------------------- explain

    async def dispatch(
        self, plan: RequestPlan, deadline: float, streams: StreamTable, locality: Mapping[str, int]
    ) -> dict[str, float]:
        started = time.monotonic()
        if has_pd_engines(self.engines):
            decide = functools.partial(self._decide_reserving, plan.request_id)
            try:
                sent = await dispatch_pd(self, decide, plan, deadline, streams, locality)
            except BaseException:
                self._unreserve(plan.request_id)
                raise
            self._opened(plan.request_id, sent.decision, started, sent.task_id)
            return sent.timings
        try:
            timings = await super().dispatch(plan, deadline, streams, locality)
        except BaseException:
            self._unreserve(plan.request_id)
            raise
        finally:
            decision = self._picked.pop(plan.request_id, None)
        if decision is not None:
            self._opened(plan.request_id, decision, started)
        return timings

    def _opened(self, request_id: str, decision: Decision, started: float, task_id: str = "") -> None:
        """`task_id`: the id its first token comes under, a retried dispatch's own (default the request's)."""
        task_id = task_id or request_id
        chosen, runner = decision.chosen, decision.runner_up
        metrics.PLANS.labels(chosen.label).inc()
        self._reserved.pop(request_id, None)  # the reservation becomes the open plan
        self.ledger.add(chosen.prefill_engine, request_id, started + self._model_s(chosen))
        path_factor = self.paths.factor(chosen.label)
        base_s = chosen.ttft_s / path_factor
        raw_s = max(0.0, base_s - self.calibration.overhead_s) / self.calibration.scale  # the profile's own
        self._engines_of[request_id] = (chosen.prefill_engine, chosen.decode_engine)
        attributes = {
            "plan": chosen.label,
            "engine_id": chosen.decode_engine,
            "prefill_engine_id": chosen.prefill_engine,
            "hit_tokens": chosen.hit_tokens,
            "predicted_ttft_s": chosen.ttft_s,
            "path_factor": path_factor,  # learned for this path (1: priced as calibrated)
            "harm_s": chosen.harm_s,
            "meets_slo": decision.meets_slo,
            "num_plans": decision.num_plans,
        }
        if runner is not None:
            attributes |= {
                "runner_up": f"{runner.label}@{runner.decode_engine}",
                "runner_up_ttft_s": runner.ttft_s,
                "runner_up_cost_s": runner.cost_s,
            }
        span = telemetry.start_span("auto_plan", attributes=attributes)
        self._open[request_id] = _Open(decision, started, span, raw_s, base_s, task_id)
        if task_id != request_id:
            self._request_of[task_id] = request_id

    def on_token_batch(self, batch: TokenBatch, now: float) -> None:
        for delta in batch.deltas:
            request_id = self._request_of.get(delta.request_id, delta.request_id)
            done = self._open.get(request_id)
            if delta.seq == 0 and done is not None and done.task_id == delta.request_id:
                self._closed(request_id, now - done.dispatched_at)

    def release(self, request_id: str) -> None:
        if request_id in self._open:
            self._closed(request_id, None)
        for engine_id in self._engines_of.pop(request_id, ()):
            self.ledger.drop(engine_id, request_id)

    def _closed(self, request_id: str, measured_s: float | None) -> None:
        done = self._open.pop(request_id)
        self._request_of.pop(done.task_id, None)
        chosen = done.decision.chosen
        if measured_s is None:
            self.ledger.drop(chosen.prefill_engine, request_id)
            telemetry.end_span(done.span, error="no first token")
            return
        self.ledger.started(chosen.prefill_engine, chosen.decode_engine, request_id)
        metrics.PLAN_TTFT_ERROR.observe(abs(chosen.ttft_s - measured_s))
        self.calibration.observe(done.raw_ttft_s, measured_s)
        self.paths.observe(chosen.label, done.base_ttft_s, measured_s)
        telemetry.end_span(done.span, attributes={"measured_ttft_s": measured_s})
        log.debug(
            "auto plan request_id=%s plan=%s engine=%s predicted_ttft_s=%.4f measured_ttft_s=%.4f"
            " raw_ttft_s=%.5f path_factor=%.3f",
            request_id,
            chosen.label,
            chosen.decode_engine,
            chosen.ttft_s,
            measured_s,
            done.raw_ttft_s,
            chosen.ttft_s / done.base_ttft_s if done.base_ttft_s > 0 else 1.0,
        )


def build_auto_dispatch(config: RouterConfig, engines: EngineTable, bus: Bus, router_id: str) -> AutoDispatch:
    """The dispatch of `--policy auto` (`dispatch_build.build_dispatch`); with `--move-query auto` held
    prefixes are among auto's plans, with a forced mode they are routed, fetched or recomputed after auto
    picked the engine, as for the colocated policies."""
    timeout_s = config.task_ack_timeout_s
    dispatch = AutoDispatch(
        engines,
        bus,
        router_id,
        timeout_s,
        cost_profile=config.cost_profile,
        kv_link=config.kv_link,
        decode_engines=config.auto_decode_engines,
    )
    if config.move_query:
        from services.router.route_choice import HeldRouting, load_profile

        dispatch.held_routing = HeldRouting(
            engines,
            mode=config.move_query,
            profile=load_profile(config.movequery_profile),
            fabric=config.movequery_fabric,
        )
    return dispatch


def _budget(report: LoadReport | None) -> int:
    """The engine's prefill token budget per step, as its load report says (else the engines' default)."""
    said = report.max_num_batched_tokens if report is not None else 0
    return said or DEFAULT_MAX_NUM_BATCHED_TOKENS

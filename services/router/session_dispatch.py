"""Session dispatch (`--policy ampd | disagg-remote | session-colocated`): AMPD and its two baselines.

Every request belongs to a session (`X-Session-Id` or `user`; a request without one is a session of its
own). A session is bound to one decode engine with `--session-kv`, which keeps its KV between turns
(`bind_session`: lowest KV occupancy, then fewest running, then id); a bound engine that died, left or keeps
refusing is replaced (the session rebinds and its next turn loads its stored KV). Each turn's prefill is
routed by the policy's mode (`services/policy/ampd.py`):
  ampd               Algorithm 1 over the windowed TTFT of every prefill engine and ITL of the bound engine;
  disagg-remote      always a prefill engine (round robin or least queue): Dynamo-style disaggregation;
  session-colocated  always the bound engine itself: vLLM-style colocation with prefix caching.
Local: a `GenerateTask` to the bound engine. Remote: a `DecodeTask` to the bound engine (it keeps the
resident blocks the prompt still starts with and names them in its buffer), then a `PrefillTask` to the
prefill engine, which reads the history from the decode engine's cache ("hbm") or from storage ("pe"),
whichever the cost model says is cheaper, and writes back only the rest (the sends: `pd_tasks.py`, shared
with `--policy auto` on P/D engines).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from services.policy.ampd import (
    LOCAL,
    MODE_AMPD,
    SOURCE_HBM,
    SOURCE_STORAGE,
    AmpdParams,
    DecodeOccupancy,
    DecodeView,
    PrefillView,
    RouteDecision,
    TurnPrefill,
    bind_session,
    policy_mode,
    remote_history,
    route_by_mode,
)
from services.policy.ampd_costs import CostModel
from services.policy.snapshot import ROLE_DECODE, ROLE_PREFILL
from services.router import metrics
from services.router.config import RouterConfig
from services.router.dispatch import (
    MAX_DISPATCH_ATTEMPTS,
    TIMER_SLACK_S,
    Dispatch,
    attempt_request_id,
    publish_abort,
    undispatched,
)
from services.router.engines import EngineTable
from services.router.measured_costs import measured_cost_model
from services.router.pd_tasks import prefill_turn, send_local, take_turn
from services.router.pd_tasks import stored_blocks as stored_count
from services.router.room_queue import RoomQueue
from services.router.sessions import Flight, FlightBook, SessionTable
from services.router.streams import StreamTable
from shared.blocks import max_hit_blocks
from shared.bus import Bus
from shared.errors import (
    DeadlineExceededError,
    EngineFailedError,
    KvpathError,
    NoEngineAvailableError,
    OverloadedError,
    ServiceUnavailableError,
)
from shared.protocol import KvPlan, RequestPlan, TokenBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionParams:
    mode: str  # one of services.policy.ampd.MODES
    ampd: AmpdParams
    window_s: float
    cost_profile: str = ""  # the `kvpath profile` file; "" builds the model from the engines' rates


class SessionDispatch(Dispatch):
    def __init__(
        self, engines: EngineTable, bus: Bus, router_id: str, ack_timeout_s: float, params: SessionParams
    ) -> None:
        super().__init__(engines, bus, router_id, ack_timeout_s)
        self.params = params
        self.sessions = SessionTable()
        self.flights = FlightBook(params.window_s)
        self.profiled = load_cost_profile(params.cost_profile) if params.cost_profile else None
        self.rng = random.Random()
        self.rr_cursor = 0
        self.room = RoomQueue()  # always-remote turns waiting for their decode engine's room

    # ------------------------------------------------------------------------------ router core hooks

    def on_token_batch(self, batch: TokenBatch, now: float) -> None:
        self.flights.observe(batch, now)

    def release(self, request_id: str) -> None:
        for attempt in range(MAX_DISPATCH_ATTEMPTS):  # and the ids of its retries
            self.flights.end(attempt_request_id(request_id, attempt))

    # -------------------------------------------------------------------------------------- dispatch

    async def dispatch(
        self, plan: RequestPlan, deadline: float, streams: StreamTable, locality: Mapping[str, int]
    ) -> dict[str, float]:
        started = time.monotonic()
        session = plan.session_id or plan.request_id
        stored_blocks = stored_count(plan, locality, self._block_size())
        tried: set[str] = set()
        error: KvpathError | None = None
        task, retries = plan, 0
        for _ in range(MAX_DISPATCH_ATTEMPTS):
            de = self._decode_engine(session, tried, locality)
            if de is None:
                break
            turn = self._turn(task, de, locality, stored_blocks)
            decision = self._route(turn, de)
            streams.assign(task.request_id, de)
            try:
                timings, decision = await self._send(task, de, decision, stored_blocks, deadline, streams)
            except (ServiceUnavailableError, DeadlineExceededError, OverloadedError) as exc:
                streams.unassign(task.request_id, de)  # the decode engine did not take it: try another
                log.warning("session engine refused request_id=%s engine=%s: %s", task.request_id, de, exc)
                await publish_abort(self.bus, task.request_id, "dispatch failed")
                self.sessions.unbind(session)
                tried.add(de)
                if isinstance(exc, ServiceUnavailableError) and self.engines.suspect(de):
                    metrics.ENGINES_SUSPECTED.inc()  # no service answers for it: out until it reports
                error = exc
                continue
            except EngineFailedError as exc:
                if not isinstance(exc.__cause__, ServiceUnavailableError):
                    raise
                # no service answers for the remote turn's PE (its DE turn is aborted): leave the PE out until
                # it reports again and decide again, under an id of its own (the abort never meets it)
                self._prefill_engine_gone(task, decision.target, streams, exc)
                retries, error = retries + 1, exc
                task = replace(plan, request_id=attempt_request_id(plan.request_id, retries))
                streams.retarget(plan.request_id, task.request_id)
                continue
            self._started(task, de, turn, decision, started)
            return timings
        raise undispatched(error, deadline, "session engine")

    def _prefill_engine_gone(
        self, task: RequestPlan, pe: str, streams: StreamTable, error: EngineFailedError
    ) -> None:
        streams.unassign(task.request_id, pe)
        if self.engines.suspect(pe):
            metrics.ENGINES_SUSPECTED.inc()
        log.warning("prefill engine gone request_id=%s engine=%s: %s", task.request_id, pe, error.message)

    async def _send(
        self,
        plan: RequestPlan,
        de: str,
        decision: RouteDecision,
        stored_blocks: int,
        deadline: float,
        streams: StreamTable,
    ) -> tuple[dict[str, float], RouteDecision]:
        """The turn to `de`, prefilled as decided; the timings and the decision carried out. A remote turn
        the decode engine refuses for want of room (DE buffer or queue full: it reserved nothing) runs on
        that engine itself under AMPD (`remote_full`); the always-remote baseline waits for the engine's
        next load report and asks again, until the deadline."""
        waited = False
        while not decision.is_local:
            pair, placed = (decision.target, de), time.monotonic()
            try:
                buffer = await take_turn(self, plan, pair, deadline, de_kv=None)
            except OverloadedError:
                if time.monotonic() >= deadline - TIMER_SLACK_S:
                    raise
                metrics.DECODE_REFUSED.inc()
                if self.params.mode == MODE_AMPD:
                    decision = RouteDecision(LOCAL, "remote_full", decision.estimate_s)
                    break
                await self.room.wait(de, deadline, again=waited)  # in line for its room (room_queue.py)
                waited = True
                continue
            if waited:
                self.room.taken(de)
            history = partial(self._history_plan, plan, stored_blocks=stored_blocks)
            timings = await prefill_turn(self, plan, pair, buffer, history, deadline, streams, placed=placed)
            return timings, decision
        return await send_local(self, plan, de, stored_blocks, deadline), decision

    def on_load_report(self, engine_id: str) -> None:
        self.room.reported(engine_id)

    def _decode_engine(self, session: str, tried: set[str], locality: Mapping[str, int]) -> str | None:
        """The session's live bound engine, or a new binding among the untried ones (`bind_session`: where
        its KV is resident, else the lowest occupancy)."""
        now = time.monotonic()
        live = [st for st in self.engines.live(now, roles=(ROLE_DECODE,)) if not st.report.is_draining]
        bound = self.sessions.bound(session)
        if bound is not None and bound not in tried and any(st.report.service_id == bound for st in live):
            return bound
        block_size = self._block_size()
        loads = [
            DecodeOccupancy(
                engine_id=st.report.service_id,
                used_kv_tokens=(st.report.total_kv_blocks - st.report.free_kv_blocks) * block_size
                + st.pending_kv_tokens,
                total_kv_tokens=st.report.total_kv_blocks * block_size,
                num_running=st.report.num_running + st.pending_requests,
            )
            for st in live
            if st.report.service_id not in tried
        ]
        resident = {e.engine_id: block_size * locality.get(f"hbm:{e.engine_id}", 0) for e in loads}
        engine_id = bind_session(loads, resident)
        if engine_id is not None:
            reason = "rebound" if bound is not None else "resident" if resident.get(engine_id) else "new"
            metrics.SESSION_BINDS.labels(reason).inc()
            self.sessions.bind(session, engine_id)
        return engine_id

    def _route(self, turn: TurnPrefill, de: str) -> RouteDecision:
        now = time.monotonic()
        prefills = [
            PrefillView(pe, self.flights.ttft.mean(pe, now), self.flights.queue(pe))
            for pe in self._live_ids(ROLE_PREFILL, now)
        ]
        self.rng.shuffle(prefills)  # Algorithm 1, line 1: "in random order"
        decode = DecodeView(de, self.flights.itl.mean(de, now), self.flights.queue(de))
        decision, self.rr_cursor = route_by_mode(
            self.params.mode, turn, decode, prefills, self.costs(), self.params.ampd, self.rr_cursor
        )
        if decision is None:
            raise NoEngineAvailableError("no live prefill engine")
        return decision

    def _turn(
        self, plan: RequestPlan, de: str, locality: Mapping[str, int], stored_blocks: int
    ) -> TurnPrefill:
        block_size = self._block_size()
        usable = max_hit_blocks(plan.num_prompt_tokens, block_size)
        resident = min(locality.get(f"hbm:{de}", 0), usable) * block_size
        stored = stored_blocks * block_size
        history = max(resident, stored)
        return TurnPrefill(
            history, plan.num_prompt_tokens - history, resident, stored, plan.ttft_slo_s, plan.itl_slo_s
        )

    def _history_plan(self, plan: RequestPlan, kept_blocks: int, *, stored_blocks: int) -> KvPlan:
        """Where the PE gets the history: the decode engine's kept blocks or storage, the cheaper."""
        block_size = self._block_size()
        usable = max_hit_blocks(plan.num_prompt_tokens, block_size)
        kept = min(kept_blocks, usable) * block_size
        stored = stored_blocks * block_size
        history = max(kept, stored)
        turn = TurnPrefill(history, plan.num_prompt_tokens - history, kept, stored, 1.0, 1.0)
        source, _, tokens = remote_history(turn, self.costs(), self.params.ampd.data_link)
        if source not in (SOURCE_HBM, SOURCE_STORAGE):
            return plan.kv.with_hits()
        return plan.kv.with_hits(tokens // block_size, source)

    def _started(
        self, plan: RequestPlan, de: str, turn: TurnPrefill, decision: RouteDecision, started: float
    ) -> None:
        metrics.SESSION_ROUTES.labels("local" if decision.is_local else "remote", decision.reason).inc()
        prefill_engine = de if decision.is_local else decision.target
        work = (turn.l_hist, turn.l_incr)
        self.flights.start(plan.request_id, Flight(prefill_engine, de, work, started, decision.is_local))
        log.debug(
            "session turn request_id=%s de=%s route=%s reason=%s estimate_s=%.4f",
            plan.request_id, de, decision.target, decision.reason, decision.estimate_s,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------ cost model

    def costs(self) -> CostModel:
        """The profile when one is configured, else a linear model from what the engines and storage
        services report (prefill rates, storage bandwidth)."""
        if self.profiled is not None:
            return self.profiled
        return measured_cost_model(
            self.engines, data_link=self.params.ampd.data_link, roles=(ROLE_PREFILL, ROLE_DECODE)
        )

    def _live_ids(self, role: str, now: float) -> list[str]:
        return [
            st.report.service_id for st in self.engines.live(now, roles=(role,)) if not st.report.is_draining
        ]

    def _block_size(self) -> int:
        return self.engines.kv_format.block_size if self.engines.kv_format is not None else 1


def session_params(config: RouterConfig) -> SessionParams:
    """The session dispatch's parameters from the router's configuration."""
    return SessionParams(
        mode=policy_mode(config.policy, config.remote_pick),
        ampd=AmpdParams(
            alpha=config.ampd_alpha,
            beta=config.ampd_beta,
            route_initial=config.ampd_route_initial,
            data_link=config.kv_link,
            slack_order=config.ampd_slack_order,
        ),
        window_s=config.ampd_window_s,
        cost_profile=config.cost_profile,
    )


def load_cost_profile(path: str) -> CostModel:
    return CostModel.from_dict(json.loads(Path(path).read_text()))

"""How a planned request reaches its engine(s): the router's one dispatch seam, and the colocated dispatch.

`RouterCore.generate` builds a request's `RequestPlan` once and hands it to the `Dispatch` of the configured
policy: `ColocatedDispatch` (one engine prefills and decodes) or `DisaggregatedDispatch`
(`disaggregated.py`: a prefill and a decode engine and a read side per request). A dispatch chooses with the
pure policies of `services/policy`, sends the tasks, registers the serving engines with the request's token
stream (their failure then fails it) and returns the router-side stage timings.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from services.policy.colocated import CACHE_AWARE, COLOCATED, pick_cache_aware, pick_least_loaded
from services.policy.snapshot import ROLE_COLOCATED, EngineSnapshot
from services.router import metrics
from services.router.engines import EngineTable
from services.router.streams import StreamTable
from shared import telemetry
from shared.bus import Bus
from shared.bus_epochs import ReplyLostError
from shared.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    KvpathError,
    NoEngineAvailableError,
    OverloadedError,
    ServiceUnavailableError,
    error_from_code,
)
from shared.protocol import Abort, GenerateTask, RequestPlan, TaskAck, TokenBatch
from shared.protocol.tasks import Task

log = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3
# refusals another engine may not share (the rest are the request's own fault)
RETRY_ELSEWHERE = (OverloadedError, ServiceUnavailableError, ContextLengthExceededError)
ENGINE_LOCAL_TIERS = ("hbm", "dram")  # KV locations that belong to one engine (`<tier>:<engine id>`)
# how early an event-loop timer may fire (uvloop times on libuv's cached millisecond clock): an ack wait cut
# to the request's deadline can end just before the clock says the deadline passed
TIMER_SLACK_S = 0.005


def fresh_plan(plan: RequestPlan) -> RequestPlan:
    """A copy of the plan whose KV part a dispatch may rewrite without touching the original's."""
    return replace(plan, kv=replace(plan.kv))


def attempt_request_id(request_id: str, attempt: int) -> str:
    """The id a dispatch sends attempt `attempt` (0, 1, ...) of a request under: the first keeps the
    request's own; a retry gets its own, so the abort of the attempt before never meets it on an engine."""
    return request_id if attempt == 0 else f"{request_id}-retry{attempt}"


def local_blocks(locality: Mapping[str, int], engine_id: str) -> int:
    """Leading prompt blocks engine `engine_id` holds in its own tiers."""
    return max((locality.get(f"{tier}:{engine_id}", 0) for tier in ENGINE_LOCAL_TIERS), default=0)


def undispatched(error: KvpathError | None, deadline: float, engines: str) -> KvpathError:
    """The error for a request no engine took, `error` being the last refusal: an overload stays a 429 and a
    prompt no tried engine's cache holds a 400; a lost ack at the request's deadline is a 504; anything else
    is a 503 naming it."""
    if isinstance(error, OverloadedError | ContextLengthExceededError):
        return error
    if isinstance(error, DeadlineExceededError) and time.monotonic() >= deadline - TIMER_SLACK_S:
        return DeadlineExceededError("the request's deadline passed while dispatching it")
    last = f" (last error: {error.message})" if error else ""
    return NoEngineAvailableError(f"no {engines} is available{last}")


class Dispatch(abc.ABC):
    """The seam between the router core and the engines. `dispatch` is called once per request, after its
    plan is built and its stream opened; it may wait (a queue for engines) but never past `deadline`."""

    def __init__(self, engines: EngineTable, bus: Bus, router_id: str, ack_timeout_s: float) -> None:
        self.engines = engines
        self.bus = bus
        self.router_id = router_id
        self.ack_timeout_s = ack_timeout_s

    @abc.abstractmethod
    async def dispatch(
        self, plan: RequestPlan, deadline: float, streams: StreamTable, locality: Mapping[str, int]
    ) -> dict[str, float]:
        """Send the request to its engine(s) and assign them to its stream; return the router's stage
        timings (seconds by stage). `locality`: leading prompt blocks each KV location holds (the index's
        per-location answer; empty without an index). Raise a `KvpathError` when no engine takes it."""

    def on_load_report(self, engine_id: str) -> None:  # noqa: B027 (a hook: most dispatches need nothing)
        """Loads changed (`engine_id` reported): queued requests may fit now."""

    def on_token_batch(self, batch: TokenBatch, now: float) -> None:  # noqa: B027
        """Token deltas arrived (router clock `now`); session policies measure TTFT and ITL here."""

    def release(self, request_id: str) -> None:  # noqa: B027
        """The request left the router (finished, failed or aborted): drop what is kept for it."""

    async def run(self) -> None:  # noqa: B027
        """Background work, run by the router service for its lifetime (none by default)."""

    def ack_timeout(self, deadline: float) -> float:
        return min(self.ack_timeout_s, max(0.01, deadline - time.monotonic()))

    async def send_task(self, engine_id: str, task: Task, deadline: float) -> TaskAck:
        """Send a task to an engine and wait for its ack (within the ack timeout and the request's deadline).

        An ack that did not come back (its timeout passed, or the NATS connection dropped while it was in
        flight) may be one the engine sent: a stalled engine, or a nats-server restart. If the engine reports
        its load again within its silence timeout, it is alive and connected, and the same task goes to it
        once more; an engine acks a task it took again (`EngineHandlers.task`), so the lost ack costs neither
        the request (it was a 503 with a single engine) nor a second run of it (another engine's, with the
        same id, while the abort of the first may have been lost too)."""
        subject = self.bus.subjects.task(engine_id)
        try:
            return await self.bus.request(subject, task, TaskAck, timeout_s=self.ack_timeout(deadline))
        except (ReplyLostError, DeadlineExceededError) as exc:
            wait = min(self.engines.silence_timeout_s, deadline - time.monotonic())
            if wait <= 0 or not await self.engines.next_report(engine_id, wait):
                raise
            log.warning(
                "task ack lost request_id=%s engine=%s (%s); the engine reports: sending the task again",
                task.request_id, engine_id, exc.message,
            )  # fmt: skip
            metrics.TASKS_RESENT.inc()
        return await self.bus.request(subject, task, TaskAck, timeout_s=self.ack_timeout(deadline))


async def publish_abort(bus: Bus, request_id: str, reason: str) -> None:
    """Tell every engine to drop the request; a bus that is down is only logged (deadlines free it too)."""
    try:
        await bus.publish(bus.subjects.abort, Abort(request_id=request_id, reason=reason))
    except Exception as exc:
        log.warning("abort publish failed request_id=%s: %r", request_id, exc)


class ColocatedDispatch(Dispatch):
    """One colocated engine per request, chosen by the policy (`services/policy/colocated.py`): least loaded
    (`colocated`, `beluga`: cache-oblivious), or cache-aware (the engine-local prefix traded against load).
    A refusal for load (or a lost ack) tries the next choice, up to MAX_DISPATCH_ATTEMPTS engines; a refusal
    of the request itself fails it."""

    def __init__(
        self, engines: EngineTable, bus: Bus, router_id: str, ack_timeout_s: float, *, policy: str = COLOCATED
    ) -> None:
        super().__init__(engines, bus, router_id, ack_timeout_s)
        self.policy = policy
        self._span_attributes = {"policy": policy}
        self.held_routing: Any = None  # services/router/route_choice.HeldRouting with move_query on

    async def dispatch(
        self, plan: RequestPlan, deadline: float, streams: StreamTable, locality: Mapping[str, int]
    ) -> dict[str, float]:
        # the `schedule` stage as a span, not made current: engine spans stay its siblings
        span = telemetry.start_span("schedule", attributes=self._span_attributes)  # None while tracing is off
        try:
            engine_id = await self._choose_and_send(GenerateTask(plan=plan), deadline, locality)
        except BaseException as exc:
            telemetry.end_span(span, error=f"{type(exc).__name__}: {exc}")
            raise
        if span is not None:
            telemetry.end_span(span, attributes={"engine_id": engine_id})
        log.debug("dispatched request_id=%s engine=%s", plan.request_id, engine_id)
        streams.assign(plan.request_id, engine_id)
        return {}

    def held_primitive(self, plan: RequestPlan) -> str | None:
        """The move-the-query primitive this policy chose with the engine (None: `held_routing` decides)."""
        return None

    def _pick(
        self, engines: list[EngineSnapshot], plan: RequestPlan, locality: Mapping[str, int]
    ) -> str | None:
        if self.policy != CACHE_AWARE:
            return pick_least_loaded(engines)
        block_size = self.engines.kv_format.block_size if self.engines.kv_format else 1
        local = {e.engine_id: block_size * local_blocks(locality, e.engine_id) for e in engines}
        return pick_cache_aware(engines, local, plan.num_prompt_tokens)

    async def _choose_and_send(self, task: GenerateTask, deadline: float, locality: Mapping[str, int]) -> str:
        tried: set[str] = set()
        refusal: KvpathError | None = None
        block_size = self.engines.kv_format.block_size if self.engines.kv_format else 1
        for _ in range(MAX_DISPATCH_ATTEMPTS):
            engines = self.engines.engine_snapshots(block_size, (ROLE_COLOCATED,))
            candidates = [e for e in engines if e.engine_id not in tried]
            if self.held_routing is not None:
                avoid = self.held_routing.avoid(locality, task.plan)
                candidates = [e for e in candidates if e.engine_id not in avoid] or candidates
            engine_id = self._pick(candidates, task.plan, locality)
            if engine_id is None:
                break
            tried.add(engine_id)
            if self.held_routing is not None:
                self.held_routing.apply(task.plan, engine_id, locality, self.held_primitive(task.plan))
            # counted at once, not at the ack: requests picked meanwhile see this one (else a burst all
            # lands on the engine that sorts first)
            self.engines.note_assigned(engine_id, task.plan.num_prompt_tokens)
            try:
                ack = await self.send_task(engine_id, task, deadline)
            except (ServiceUnavailableError, DeadlineExceededError) as exc:
                self.engines.note_unassigned(engine_id, task.plan.num_prompt_tokens)
                log.warning("task not acked request_id=%s engine=%s: %s", task.request_id, engine_id, exc)
                if isinstance(exc, ServiceUnavailableError) and self.engines.suspect(engine_id):
                    metrics.ENGINES_SUSPECTED.inc()  # no service answers for it: out until it reports
                await publish_abort(self.bus, task.request_id, "dispatch failed")
                refusal = exc
                continue
            except BaseException:
                self.engines.note_unassigned(engine_id, task.plan.num_prompt_tokens)
                raise
            if ack.accepted:
                return engine_id
            self.engines.note_unassigned(engine_id, task.plan.num_prompt_tokens)
            refusal = error_from_code(ack.code or "overloaded", ack.message or "engine refused the task")
            # a context-length refusal is this engine's cache (the router checked the model's context):
            # an engine with a larger cache may take the prompt
            if not isinstance(refusal, RETRY_ELSEWHERE):
                raise refusal  # the request itself is bad: another engine would refuse it too
        raise undispatched(refusal, deadline, "engine")

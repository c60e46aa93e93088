"""Router core: turn a validated request into an engine task and its token stream into text pieces.

HTTP-agnostic: `api.py` renders the pieces as OpenAI JSON or SSE. Every wait has the request's deadline;
every failure (engine refused, died, went silent, lost tokens) ends the stream with an error, unless the
attempt was lost with an engine: then it is sent again, with the tokens the client got (`redispatch.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.router import metrics
from services.router.auto_dispatch import AutoDispatch
from services.router.auto_pd import has_pd_engines
from services.router.choices import ChoiceGate, ChoiceGroup
from services.router.config import RouterConfig
from services.router.dispatch import ColocatedDispatch, publish_abort
from services.router.dispatch_build import build_dispatch
from services.router.dualpath_dispatch import DisaggregatedDispatch
from services.router.engine_return import dispatch_or_wait
from services.router.engines import EngineTable
from services.router.kv_plan import KvPlanner
from services.router.prompts import PreparedPrompt, sampling_params
from services.router.redispatch import Redispatch
from services.router.resend import RESEND_TIMEOUT_S
from services.router.stops import StopMatcher
from services.router.streams import RequestStream, StreamTable
from shared import logs, telemetry
from shared.bus import Bus
from shared.errors import (
    DeadlineExceededError,
    EngineFailedError,
    InvalidRequestError,
    KvpathError,
    NoEngineAvailableError,
    OverloadedError,
    TransportError,
    error_from_code,
)
from shared.hashing import kv_salt, session_key
from shared.protocol import LoadReport, RequestPlan, TokenBatch, TokenDelta
from shared.protocol.movequery import ChunkName
from shared.protocol.tasks import choice_request_id

log = logging.getLogger(__name__)

REORDER_WINDOW_S = 2.0  # a delta may overtake its predecessor this long (PE -> DE hand-off)


@dataclass(slots=True)
class Piece:
    """Text produced since the previous piece; the last piece carries the finish reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)  # per token [logprob, top ids, top logprobs]


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


class RouterCore:
    def __init__(self, config: RouterConfig, bus: Bus, router_id: str) -> None:
        self.config = config
        self.bus = bus
        self.router_id = router_id
        self.streams = StreamTable()
        self.engines = EngineTable(config.engine_silence_timeout_s, return_wait_s=config.engine_return_wait_s)
        self.inflight = 0
        self.draining = False  # stopping: the API refuses new requests (503)
        self.is_idle = asyncio.Event()
        self.is_idle.set()
        self.dispatch = build_dispatch(config, self.engines, bus, router_id)
        self.kv_planner = KvPlanner(bus, use_index=config.use_kv_cache, timeout_s=config.index_timeout_s)
        # with move the query on, the planner holds a burst's undecided requests where its routing counts them
        self.kv_planner.undecided = getattr(getattr(self.dispatch, "held_routing", None), "undecided", None)

    # ------------------------------------------------------------------------------------ bus inputs

    def on_token_batch(self, batch: TokenBatch) -> None:
        now = time.monotonic()
        self.streams.deliver(batch, now)
        self.dispatch.on_token_batch(batch, now)

    def on_load_report(self, report: LoadReport) -> None:
        previous = self.engines.get(report.service_id)
        self.engines.update(report, time.monotonic())
        old = previous.report.incarnation_unix_s if previous is not None else 0.0
        if old and report.incarnation_unix_s > old:  # restarted under its id: its old streams are lost
            error = EngineFailedError(f"engine {report.service_id} restarted; the request was lost with it")
            n = self.streams.fail_engine(report.service_id, error, assigned_before=report.incarnation_unix_s)
            if n:
                metrics.ENGINE_FAILURES.labels("restarted").inc(n)
                log.warning("engine restarted engine=%s failed_streams=%d", report.service_id, n)
        self.dispatch.on_load_report(report.service_id)

    def fail_silent_engines(self) -> int:
        """Fail the streams of engines whose load reports stopped, and streams with a token gap that did not
        close in time (a lost message); return how many streams failed."""
        failed = self.streams.expire_gaps(time.monotonic(), REORDER_WINDOW_S, ask_wait_s=RESEND_TIMEOUT_S)
        if failed:
            metrics.ENGINE_FAILURES.labels("token_gap").inc(failed)
        for engine_id in self.streams.engines_with_streams():
            state = self.engines.get(engine_id)
            if state is None or engine_id in self.engines.silent(time.monotonic()):
                n = self.streams.fail_engine(
                    engine_id,
                    EngineFailedError(
                        f"engine {engine_id} stopped responding (no load report for "
                        f"{self.config.engine_silence_timeout_s:.1f}s)"
                    ),
                )
                if n:
                    metrics.ENGINE_FAILURES.labels("silent").inc(n)
                    log.warning("engine silent engine=%s failed_streams=%d", engine_id, n)
                failed += n
        return failed

    # ------------------------------------------------------------------------------------ generation

    def new_request_id(self, endpoint: str) -> str:
        """A fresh id, bound to the calling handler task: every later log line of the request carries it,
        and it names the request's HTTP span."""
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        logs.bind_request_id(request_id)
        telemetry.set_current_attribute("request_id", request_id)
        log.debug("request accepted request_id=%s endpoint=%s", request_id, endpoint)
        return request_id

    @property
    def shares_prompt(self) -> bool:
        """Whether a request's n choices go as one task, forked by the engine from one prefill (colocated
        engines without move-the-query, DualPath's decode engines); else as n tasks of one choice."""
        dispatch = self.dispatch
        if isinstance(dispatch, AutoDispatch) and has_pd_engines(self.engines):
            return False  # session engines take one choice per task
        if isinstance(dispatch, ColocatedDispatch):
            return dispatch.held_routing is None
        return isinstance(dispatch, DisaggregatedDispatch)

    def generate_choices(
        self, prompt: PreparedPrompt, request_id: str, usages: list[Usage]
    ) -> list[AsyncGenerator[Piece]]:
        """One generator per choice (`len(usages)` of them; services/router/choices.py), as `generate`."""
        n = len(usages)
        first = choice_request_id(request_id, 0)
        group = None if n == 1 else ChoiceGroup(n) if self.shares_prompt else ChoiceGate(first)
        return [
            self.generate(prompt, choice_request_id(request_id, i), usages[i], i, group) for i in range(n)
        ]

    async def generate(
        self,
        prompt: PreparedPrompt,
        request_id: str,
        usage: Usage,
        choice: int = 0,
        group: ChoiceGroup | ChoiceGate | None = None,
    ) -> AsyncGenerator[Piece]:
        """Dispatch and stream. The caller must exhaust or close the iterator (closing aborts the request).
        `choice`: which of the request's n samples (its seed is the request's plus `choice`); `group`: the
        choices sent as one task (choice 0 dispatches it), or as n behind choice 0 (router/choices.py)."""
        if self.inflight >= self.config.max_inflight_requests:
            raise OverloadedError(f"router has {self.inflight} requests in flight; retry later")
        started = time.monotonic()
        deadline = started + self.config.request_deadline_s
        self.inflight += 1
        self.is_idle.clear()
        metrics.QUEUED.inc()
        stream: RequestStream | None = None
        again: Redispatch | None = None
        is_finished = False
        try:
            stream, again = await self._open(prompt, request_id, usage, deadline, choice, group)
            metrics.QUEUED.dec()
            metrics.RUNNING.inc()
            # one timer per request, not one per wait: at the deadline the stream gets the deadline error
            expiry = asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), stream.put_error, self._deadline_error()
            )
            try:
                async for piece in self._pieces(stream, prompt, deadline, usage, started, again):
                    if piece.finish_reason is not None:  # a stop string may end it here first: abort
                        is_finished = stream.is_finished  # the engine's part then (it sent no finish)
                    if group is not None:
                        group.first_piece()
                    yield piece
            finally:
                expiry.cancel()
                metrics.RUNNING.dec()
        except BaseException:
            if stream is None or not stream.engine_ids:
                metrics.QUEUED.dec()
            raise
        finally:
            self.dispatch.release(request_id)
            if again is not None and again.task_id != request_id:
                self.dispatch.release(again.task_id)
            self.inflight -= 1
            if not self.inflight:
                self.is_idle.set()
            if group is not None:
                group.ended(request_id)
            task_ids = self.streams.close(request_id)
            if not is_finished:
                for task_id in task_ids:
                    await publish_abort(self.bus, task_id, "client gone or request failed")

    async def _open(
        self,
        prompt: PreparedPrompt,
        request_id: str,
        usage: Usage,
        deadline: float,
        choice: int,
        gated: ChoiceGroup | ChoiceGate | None,
    ) -> tuple[RequestStream, Redispatch | None]:
        """The choice's token stream once dispatched (choice 0 of a group for all) and its redispatch."""
        group = gated if isinstance(gated, ChoiceGroup) else None
        if gated is not None and choice > 0:
            try:
                joined = await gated.join(self.streams, request_id, deadline - time.monotonic())
            except TimeoutError:
                raise self._deadline_error() from None
            if joined is not None:
                return joined, gated.again(choice) if isinstance(gated, ChoiceGroup) else None
        others = [choice_request_id(request_id, i) for i in range(1, group.num_choices)] if group else []
        try:
            plan, locality = await self._plan(prompt, request_id, deadline, choice, len(others) + 1)
            # open before dispatch: the first tokens may arrive before the ack
            stream = self.streams.open(request_id)
            stream.choice_ids = others
            for other in others:
                if group is not None and other not in group.left:
                    self.streams.open(other)
            again = Redispatch.of(plan.choice(0), locality, self.config.max_redispatches)
            if group is not None:
                group.first = again
            if gated is not None and choice == 0:
                gated.dispatched_prompt(plan.kv, locality, self.kv_planner)
            timings = await dispatch_or_wait(self.dispatch, plan, deadline, self.streams, locality)
            usage.timings.update(timings)
        except BaseException as exc:
            self.kv_planner.decided(request_id)
            if group is not None:
                cancelled = EngineFailedError("the request ended before its choices were dispatched")
                group.resolve(exc if isinstance(exc, Exception) else cancelled)
            raise
        for other in (o for o in others if self.streams.get(o) is not None):
            for engine_id in stream.engine_ids:  # the engine's failure fails every choice
                self.streams.assign(other, engine_id)
        if group is not None:
            group.resolve()
        return stream, again

    async def _redispatch(
        self, stream: RequestStream, again: Redispatch | None, deadline: float, cause: str
    ) -> bool:
        """Send the request again after its attempt was lost (`cause`), from its tokens so far (redispatch);
        False when it may not."""
        if again is None or not again.may(deadline):
            return False
        kv = (self.kv_planner, self.engines.kv_format)
        return await again.send(self.dispatch, self.streams, stream, deadline, cause, kv)

    async def _plan(
        self, prompt: PreparedPrompt, request_id: str, deadline: float, choice: int, num_choices: int = 1
    ) -> tuple[RequestPlan, Mapping[str, int]]:
        """The request's plan, built once (every task kind carries it as it is), and where its prefix lies."""
        kv_format = self.engines.kv_format
        if kv_format is None:
            raise NoEngineAvailableError("no engine has reported yet")
        sampling = sampling_params(prompt, choice, num_choices)
        pin = None
        if prompt.request.kv_chunk:  # names are the tenant's own, as its KV is
            if getattr(self.dispatch, "held_routing", None) is None:
                raise InvalidRequestError("'kv_chunk' needs a router run with --move-query", param="kv_chunk")
            pin = ChunkName(name=prompt.request.kv_chunk, tenant=prompt.request.tenant)
        salt = kv_salt(prompt.request.tenant, prompt.request.cache_salt)
        planned = await self.kv_planner.plan(prompt.token_ids, kv_format, request_id, salt)
        plan = RequestPlan(
            request_id=request_id,
            router_id=self.router_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            deadline_unix_s=time.time() + (deadline - time.monotonic()),
            session_id=session_key(prompt.request.session_id, salt),
            kv=planned.kv,
            ttft_slo_s=(prompt.request.ttft_slo_ms or self.config.ttft_slo_ms) / 1000,
            itl_slo_s=(prompt.request.itl_slo_ms or self.config.itl_slo_ms) / 1000,
            pin=pin,
        )
        return plan, planned.blocks_by_location

    async def _pieces(
        self,
        stream: RequestStream,
        prompt: PreparedPrompt,
        deadline: float,
        usage: Usage,
        started: float,
        again: Redispatch | None = None,
    ) -> AsyncIterator[Piece]:
        decoder = prompt.tokenizer.incremental_decoder()
        stops = StopMatcher(prompt.request.stop)
        last_token_at = 0.0
        while True:
            try:
                deltas = await self._next_deltas(stream, deadline)
            except EngineFailedError:
                engine = stream.lost_engine
                if engine and await self._redispatch(stream, again, deadline, f"engine {engine} lost"):
                    continue
                raise
            token_ids = deltas[0].token_ids if len(deltas) == 1 else [t for d in deltas for t in d.token_ids]
            num_tokens = again.record(token_ids) if again is not None else len(token_ids)
            now = time.monotonic()
            if num_tokens:
                if usage.completion_tokens == 0:
                    metrics.TTFT.observe(now - started)
                elif last_token_at:
                    metrics.ITL.observe((now - last_token_at) / num_tokens)
                last_token_at = now
            first = deltas[0]
            if first.seq == 0 and not (again and again.resumed):  # usage counts the prompt the client sent
                usage.prompt_tokens, usage.cached_tokens = first.prompt_tokens, first.cached_tokens
                usage.timings.update(first.timings)
                _observe_stages(first.timings)
            usage.completion_tokens += num_tokens
            metrics.GENERATION_TOKENS.inc(num_tokens)
            finish = deltas[-1].finish_reason
            if finish == "error":
                last = deltas[-1]
                code, message = last.error_code or "engine_failed", last.error_message or "engine error"
                error = error_from_code(code, message)
                peer_lost = isinstance(error, TransportError) and not num_tokens
                if peer_lost and last.error_engine and self.engines.suspect(last.error_engine):
                    metrics.ENGINES_SUSPECTED.inc()
                    log.warning("engine suspect engine=%s: %s", last.error_engine, error.message)
                if peer_lost and await self._redispatch(stream, again, deadline, error.message):
                    continue
                raise error
            logprobs = [lp for d in deltas for lp in d.logprobs]
            text, hit_stop = stops.feed(decoder.push(token_ids))
            if hit_stop:
                yield Piece(text, token_ids, "stop", logprobs)
                return
            if finish is not None:
                text += stops.feed(decoder.flush())[0] + stops.flush()
                metrics.E2E.observe(now - started)
                yield Piece(text, token_ids, finish, logprobs)
                return
            yield Piece(text, token_ids, None, logprobs)

    async def _next_deltas(self, stream: RequestStream, deadline: float) -> list[TokenDelta]:
        """Wait for the next delta, then take every delta already queued (coalescing a slow reader).

        The wait ends at the deadline too: `generate` arms a timer that puts the deadline error in the queue.
        """
        if deadline - time.monotonic() <= 0:
            raise self._deadline_error()
        items = [await stream.queue.get()]
        while not stream.queue.empty() and not isinstance(items[-1], KvpathError):
            if isinstance(items[-1], TokenDelta) and items[-1].finish_reason is not None:
                break
            items.append(stream.queue.get_nowait())
        deltas: list[TokenDelta] = []
        for it in items:
            if isinstance(it, KvpathError):
                if deltas:
                    stream.queue.put_nowait(it)  # deliver the tokens first, the error next
                    break
                raise it
            deltas.append(it)
        return deltas

    def _deadline_error(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"request exceeded its {self.config.request_deadline_s:.0f}s deadline")


def _observe_stages(timings: dict[str, float]) -> None:
    """TTFT stages measured by the engine (read: fetching the stored prefix; import: copying it into the
    cache during prefill; queue; prefill) into the breakdown histogram."""
    for stage in ("read", "import", "queue", "prefill"):
        value = timings.get(f"{stage}_s")
        if value is not None:
            metrics.TTFT_STAGE.labels(stage).observe(value)

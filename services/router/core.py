"""Router core: turn a validated request into an engine task and its token stream into text pieces.

HTTP-agnostic: `api.py` renders the pieces as OpenAI JSON or SSE. Every wait has the request's deadline;
every failure (engine refused, died, went silent, lost tokens) ends the stream with an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from services.policy.placement import pick_least_loaded
from services.router import metrics
from services.router.config import RouterConfig
from services.router.disagg import DisaggregatedDispatch
from services.router.engines import EngineTable
from services.router.kv_plan import KvPlanner
from services.router.prompts import PreparedPrompt
from services.router.stops import StopMatcher
from services.router.streams import RequestStream, StreamTable
from shared import logs, telemetry
from shared.bus import Bus
from shared.errors import (
    DeadlineExceededError,
    EngineFailedError,
    KvpathError,
    NoEngineAvailableError,
    OverloadedError,
    ServiceUnavailableError,
    error_from_code,
)
from shared.protocol import Abort, GenerateTask, LoadReport, SamplingParams, TaskAck, TokenBatch, TokenDelta

log = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3
REORDER_WINDOW_S = 2.0
_COLOCATED = {"policy": "colocated"}  # a delta may overtake its predecessor this long (PE -> DE hand-off)


@dataclass(slots=True)
class Piece:
    """Text produced since the previous piece; the last piece carries the finish reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


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
        self.engines = EngineTable(config.engine_silence_timeout_s)
        self.inflight = 0
        self.is_idle = asyncio.Event()
        self.is_idle.set()
        self.kv_planner: KvPlanner | None = None
        self.disagg: DisaggregatedDispatch | None = None  # prefill/decode policies; None: colocated

    # ------------------------------------------------------------------------------------ bus inputs

    def on_token_batch(self, batch: TokenBatch) -> None:
        self.streams.deliver(batch, time.monotonic())

    def on_load_report(self, report: LoadReport) -> None:
        self.engines.update(report, time.monotonic())
        if self.disagg is not None:
            self.disagg.dispatcher.kick()  # loads changed: queued requests may fit now

    def fail_silent_engines(self) -> int:
        """Fail the streams of engines whose load reports stopped, and streams with a token gap that did not
        close in time (a lost message); return how many streams failed."""
        failed = self.streams.expire_gaps(time.monotonic(), REORDER_WINDOW_S)
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

    # -------------------------------------------------------------------------------------- dispatch

    async def _dispatch(self, task: GenerateTask, deadline: float) -> str:
        """The colocated `schedule` stage as a span (not made current: engine spans stay its siblings)."""
        span = telemetry.start_span("schedule", attributes=_COLOCATED)  # None while tracing is off
        try:
            engine_id = await self._choose_and_send(task, deadline)
        except BaseException as exc:
            telemetry.end_span(span, error=f"{type(exc).__name__}: {exc}")
            raise
        if span is not None:
            telemetry.end_span(span, attributes={"engine_id": engine_id})
        log.debug("dispatched request_id=%s engine=%s", task.request_id, engine_id)
        return engine_id

    async def _choose_and_send(self, task: GenerateTask, deadline: float) -> str:
        """Send the task to the least-loaded engine that accepts it; return that engine's id."""
        tried: set[str] = set()
        refusal: KvpathError | None = None
        for _ in range(MAX_DISPATCH_ATTEMPTS):
            engines = self.engines.engine_snapshots(self.config.block_size, ("colocated",))
            candidates = [e for e in engines if e.engine_id not in tried]
            engine_id = pick_least_loaded(candidates)
            if engine_id is None:
                break
            tried.add(engine_id)
            timeout = min(self.config.task_ack_timeout_s, max(0.01, deadline - time.monotonic()))
            try:
                ack = await self.bus.request(
                    self.bus.subjects.task(engine_id), task, TaskAck, timeout_s=timeout
                )
            except (ServiceUnavailableError, DeadlineExceededError) as exc:
                log.warning("task not acked request_id=%s engine=%s: %s", task.request_id, engine_id, exc)
                await self._abort(task.request_id, "dispatch failed")
                refusal = exc
                continue
            if ack.accepted:
                self.engines.note_assigned(engine_id, len(task.prompt_token_ids))
                return engine_id
            refusal = error_from_code(ack.code or "overloaded", ack.message or "engine refused the task")
            if not isinstance(refusal, OverloadedError | ServiceUnavailableError):
                raise refusal  # the request itself is bad: another engine would refuse it too
        if isinstance(refusal, OverloadedError):
            raise refusal
        raise NoEngineAvailableError(
            "no engine is available" + (f" (last error: {refusal.message})" if refusal else "")
        )

    async def _abort(self, request_id: str, reason: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.abort, Abort(request_id=request_id, reason=reason))
        except Exception as exc:  # the bus may be down; the engine's deadline still frees the slot
            log.warning("abort publish failed request_id=%s: %r", request_id, exc)

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

    async def generate(self, prompt: PreparedPrompt, request_id: str, usage: Usage) -> AsyncGenerator[Piece]:
        """Dispatch and stream. The caller must exhaust or close the iterator (closing aborts the request)."""
        if self.inflight >= self.config.max_inflight_requests:
            raise OverloadedError(f"router has {self.inflight} requests in flight; retry later")
        started = time.monotonic()
        deadline = started + self.config.request_deadline_s
        self.inflight += 1
        self.is_idle.clear()
        metrics.QUEUED.inc()
        stream: RequestStream | None = None
        is_finished = False
        try:
            kv = await self._kv_plan(prompt, request_id)
            task = self._task(prompt, request_id, deadline, kv)
            # open before dispatch: the first tokens may arrive before the ack
            stream = self.streams.open(request_id)
            if self.disagg is None:
                self.streams.assign(request_id, await self._dispatch(task, deadline))
            else:
                usage.timings.update(
                    await self.disagg.dispatch(prompt, request_id, task.sampling, deadline, kv, self.streams)
                )
            metrics.QUEUED.dec()
            metrics.RUNNING.inc()
            # one timer per request, not one per wait: at the deadline the stream gets the deadline error
            expiry = asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), stream.put_error, self._deadline_error()
            )
            try:
                async for piece in self._pieces(stream, prompt, deadline, usage, started):
                    if piece.finish_reason is not None:
                        is_finished = True
                    yield piece
            finally:
                expiry.cancel()
                metrics.RUNNING.dec()
        except BaseException:
            if stream is None or not stream.engine_ids:
                metrics.QUEUED.dec()
            raise
        finally:
            self.inflight -= 1
            if not self.inflight:
                self.is_idle.set()
            if stream is not None:
                self.streams.close(request_id)
            if not is_finished:
                await self._abort(request_id, "client gone or request failed")

    def _task(self, prompt: PreparedPrompt, request_id: str, deadline: float, kv: dict) -> GenerateTask:
        req = prompt.request
        sampling = SamplingParams(
            max_tokens=prompt.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            min_tokens=min(req.min_tokens, prompt.max_tokens),
            stop_token_ids=req.stop_token_ids,
        )
        return GenerateTask(
            request_id=request_id,
            router_id=self.router_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            deadline_unix_s=time.time() + (deadline - time.monotonic()),
            session_id=req.session_id,
            kv=kv,
        )

    async def _kv_plan(self, prompt: PreparedPrompt, request_id: str) -> dict:
        if self.kv_planner is None:
            return {}
        return await self.kv_planner.plan(prompt, request_id)

    async def _pieces(
        self, stream: RequestStream, prompt: PreparedPrompt, deadline: float, usage: Usage, started: float
    ) -> AsyncIterator[Piece]:
        decoder = prompt.tokenizer.incremental_decoder()
        stops = StopMatcher(prompt.request.stop)
        last_token_at = 0.0
        while True:
            deltas = await self._next_deltas(stream, deadline)
            token_ids = deltas[0].token_ids if len(deltas) == 1 else [t for d in deltas for t in d.token_ids]
            num_tokens = len(token_ids)
            now = time.monotonic()
            if num_tokens:
                if usage.completion_tokens == 0:
                    metrics.TTFT.observe(now - started)
                elif last_token_at:
                    metrics.ITL.observe((now - last_token_at) / num_tokens)
                last_token_at = now
            first = deltas[0]
            if first.seq == 0:
                usage.prompt_tokens, usage.cached_tokens = first.prompt_tokens, first.cached_tokens
                usage.timings.update(first.timings)
                _observe_stages(first.timings)
            usage.completion_tokens += num_tokens
            metrics.GENERATION_TOKENS.inc(num_tokens)
            finish = deltas[-1].finish_reason
            if finish == "error":
                last = deltas[-1]
                raise error_from_code(
                    last.error_code or "engine_failed", last.error_message or "engine error"
                )
            text, hit_stop = stops.feed(decoder.push(token_ids))
            if hit_stop:
                yield Piece(text, token_ids, "stop")
                return
            if finish is not None:
                text += stops.feed(decoder.flush())[0] + stops.flush()
                metrics.E2E.observe(now - started)
                yield Piece(text, token_ids, finish)
                return
            yield Piece(text, token_ids)

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
    """TTFT stages measured by the engine (read, queue, prefill) into the breakdown histogram."""
    for stage in ("read", "queue", "prefill"):
        value = timings.get(f"{stage}_s")
        if value is not None:
            metrics.TTFT_STAGE.labels(stage).observe(value)

"""The replay engine: closed-loop agents against an OpenAI-compatible server.

Each session (agent) is one task that sends its calls back to back: the next call leaves once the previous
response has finished streaming and the recorded tool latency has passed. `offline` starts every agent at
t=0 and measures JCT; `online` starts agents at Poisson (or trace) arrival times and stops on the first of:
arrivals exhausted and agents done, `--duration-s` reached and agents done, TTFT steady (DualPath's rule,
`--stop-when-steady`), windowed TTFT past the SLO (`--stop-on-slo`), or `stop` set (Ctrl-C). On a stop the
in-flight requests are cancelled and reported as such; everything finished so far stays in the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.client import OpenAIClient
from loadgen.config import ReplayConfig
from loadgen.metrics import CallRecord, is_steady, window_mean
from loadgen.plan import SessionSource, poisson_arrivals
from loadgen.progress import Progress
from loadgen.sessions import CallOutput, SessionScript

log = logging.getLogger(__name__)

_WATCH_PERIOD_S = 0.5


@dataclass(slots=True)
class RunState:
    records: list[CallRecord] = field(default_factory=list)
    arrivals_s: dict[str, float] = field(default_factory=dict)
    itl_s: array = field(default_factory=lambda: array("d"))  # type: ignore[type-arg]
    ttft_samples: list[tuple[float, float]] = field(default_factory=list)  # (send time, TTFT)
    sessions_started: int = 0
    sessions_finished: int = 0
    history_fallbacks: int = 0
    stop_reason: str = ""
    duration_s: float = 0.0


class Replayer:
    def __init__(
        self,
        config: ReplayConfig,
        source: SessionSource,
        client: OpenAIClient,
        progress: Progress,
        stop: asyncio.Event,
    ) -> None:
        self.config, self.source, self.client, self.progress, self.stop = (
            config,
            source,
            client,
            progress,
            stop,
        )
        self.state = RunState()
        self._limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> RunState:
        """Run to the end (or a stop) and return what was measured; bad arrival options raise first."""
        if self.config.mode == "online":
            driver = self._online(self._arrival_clock())
        else:
            driver = self._offline()
        main = asyncio.create_task(driver)
        watcher = asyncio.create_task(self._watch())
        stopped = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({main, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (main, watcher, stopped, *self._tasks):
                task.cancel()
            await asyncio.gather(main, watcher, stopped, *self._tasks, return_exceptions=True)
            self.state.duration_s = self.client.now()
            self.progress.close(self.state.duration_s)
        if not self.state.stop_reason:
            self.state.stop_reason = "completed"
        if main.done() and not main.cancelled() and main.exception() is not None:
            raise main.exception()  # type: ignore[misc]
        return self.state

    def _start(self, index: int) -> None:
        script = self.source.make(index)
        self.state.arrivals_s[script.session_id] = self.client.now()
        self.state.sessions_started += 1
        self.progress.sessions += 1
        task = asyncio.create_task(self._session(script))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _offline(self) -> None:
        for index in range(self.config.agents or self.source.size):
            self._start(index)
        await self._drain()

    async def _online(self, arrival: Callable[[int], float]) -> None:
        # Poisson arrivals with a duration cycle the slice until the duration; otherwise the slice runs once
        unlimited = self._uses_poisson() and self.config.duration_s > 0
        count = self.config.agents or (None if unlimited else self.source.size)
        index = 0
        while count is None or index < count:
            at_s = arrival(index)
            if self.config.duration_s and at_s > self.config.duration_s:
                break
            delay = at_s - self.client.now()
            if delay > 0:
                await asyncio.sleep(delay)
            self._start(index)
            index += 1
        await self._drain()

    def _uses_poisson(self) -> bool:
        return self.config.arrivals == "poisson" or (self.config.arrivals == "auto" and self.config.rate > 0)

    def _arrival_clock(self) -> Callable[[int], float]:
        if self._uses_poisson():
            return poisson_arrivals(self.config.rate, self.config.seed)
        if self.source.trace_arrival_s(0) is None:
            raise ValueError("this trace has no arrival times: pass --rate R for Poisson arrivals")
        first = self.source.trace_arrival_s(0) or 0.0

        def at(index: int) -> float:
            value = self.source.trace_arrival_s(index)
            return 0.0 if value is None else value - first

        return at

    async def _drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self.state.stop_reason = self.state.stop_reason or "completed"

    async def _session(self, script: SessionScript) -> None:
        previous: CallOutput | None = None
        try:
            while (request := script.next_call(previous)) is not None:
                t_ready = self.client.now()
                async with self._limit or contextlib.nullcontext():
                    self.progress.on_send()
                    record, previous = await self.client.send(request, t_ready, self.state.records)
                self._on_record(record)
                if not record.ok and self.config.on_error == "end-session":
                    break
                if request.tool_latency_s and self.config.tool_scale:
                    await asyncio.sleep(request.tool_latency_s * self.config.tool_scale)
        finally:
            self.state.history_fallbacks += script.history_fallbacks
            self.state.sessions_finished += 1

    def _on_record(self, record: CallRecord) -> None:
        self.progress.on_record(record, self.client.now())
        self.state.itl_s.extend(record.itl_s)
        # the ITL samples now live in the state; a long run must not keep every chunk twice
        record.itl_s, record.chunk_times_s, record.chunk_tokens = [], [], []
        if record.ok and record.ttft_s is not None:
            self.state.ttft_samples.append((record.t_start_s, record.ttft_s))
        if not record.ok:
            log.debug(
                "request failed session=%s turn=%d code=%s", record.session_id, record.turn, record.error_code
            )

    async def _watch(self) -> None:
        cfg = self.config
        interval = 0.5 if self.progress.mode == "bar" else cfg.progress_interval_s
        next_tick = interval
        while True:
            await asyncio.sleep(_WATCH_PERIOD_S)
            now = self.client.now()
            if now >= next_tick:
                self.progress.tick(now)
                next_tick = now + interval
            if cfg.mode != "online":
                continue
            samples = self.state.ttft_samples
            if cfg.stop_when_steady and is_steady(
                samples,
                now,
                window_s=cfg.steady_window_s,
                lag_s=cfg.steady_lag_s,
                tolerance=cfg.steady_tolerance,
            ):
                self._request_stop("steady")
            recent, n = window_mean(samples, now - cfg.steady_window_s, now)
            if cfg.stop_on_slo and recent is not None and n >= 5 and recent > cfg.ttft_slo_s:
                self._request_stop("ttft_slo_exceeded")

    def interrupt(self) -> None:
        """Ctrl-C / SIGTERM: stop now and keep what finished (safe to call from a signal handler)."""
        self._request_stop("interrupted")

    def _request_stop(self, reason: str) -> None:
        if not self.state.stop_reason:
            self.state.stop_reason = reason
            log.info("stopping: %s at t=%.1fs", reason, self.client.now())
        self.stop.set()

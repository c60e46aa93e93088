"""Load driver for `kvpath bench router`: a process that poses as a colocated engine, with no model.

A benchmark harness, not a test stub and not an engine: it registers and reports load like an engine (role
`colocated`, plenty of free KV), accepts every `GenerateTask` with a `TaskAck`, and then, at a fixed step
rate, publishes one `TokenBatch` per router per step carrying one token for every active request (the
coalescing a real engine does). Its per-step work is a few dict copies and one orjson dump per router, so
what `bench router` measures is the router, the bus and HTTP streaming.

Run it as `python -m loadgen.bench.load_driver --step-hz 50 ...` (flags, `KVPATH_*` environment and YAML
section `bench-engine` as for every service).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from shared.bus import MsgContext
from shared.config import BaseConfig, check, doc
from shared.errors import OverloadedError, ServiceUnavailableError
from shared.protocol import Abort, GenerateTask, KvFormat, LoadReport, TaskAck, TokenBatch, TokenDelta
from shared.service import Service, serve_main

# the router hashes prompts with the KV format engines announce; the driver holds no KV, any format does
DRIVER_KV_FORMAT = KvFormat(fingerprint="kvpath-bench-load-driver", block_size=64, bytes_per_token=1)


@dataclass(slots=True)
class LoadDriverConfig(BaseConfig):
    step_hz: float = doc(50.0, "engine steps per second: every active request gets one token per step")
    max_running: int = doc(8192, "requests beyond this many active ones are refused as overloaded")
    total_kv_blocks: int = doc(1_000_000, "KV blocks reported (all free): the router never runs out")
    token_ids: list[int] = doc(list(range(97, 123)), "token ids emitted in turn ('a'..'z' bytes)")  # noqa: RUF009

    def validate(self) -> None:
        BaseConfig.validate(self)
        check(self.step_hz > 0, "step_hz", self.step_hz, "must be > 0")
        check(self.max_running >= 1, "max_running", self.max_running, "must be >= 1")
        check(bool(self.token_ids), "token_ids", self.token_ids, "must not be empty")


@dataclass(slots=True)
class DriverStream:
    request_id: str
    router_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_sent: int = 0


class StepEncoder:
    """Builds the wire bytes of one step's `TokenBatch`es straight from dicts (same format as `encode`)."""

    __slots__ = ("_batch", "_delta", "token_ids")

    def __init__(self, engine_id: str, token_ids: Sequence[int]) -> None:
        self._delta = TokenDelta(request_id="", seq=0, token_ids=[]).to_dict()
        self._batch = TokenBatch(engine_id=engine_id, step=0, deltas=[]).to_dict()
        self.token_ids = list(token_ids)

    def step(self, streams: Iterable[DriverStream], step: int) -> tuple[dict[str, bytes], list[str]]:
        """One token for every stream: (wire bytes by router id, ids of the streams that finished)."""
        by_router: dict[str, list[dict[str, Any]]] = {}
        finished: list[str] = []
        template, tokens = self._delta, self.token_ids
        for s in streams:
            delta = template.copy()
            delta["request_id"] = s.request_id
            delta["seq"] = s.num_sent
            delta["token_ids"] = [tokens[s.num_sent % len(tokens)]]
            if s.num_sent == 0:
                delta["prompt_tokens"] = s.num_prompt_tokens
            s.num_sent += 1
            if s.num_sent >= s.max_tokens:
                delta["finish_reason"] = "length"
                finished.append(s.request_id)
            deltas = by_router.get(s.router_id)
            if deltas is None:
                deltas = by_router[s.router_id] = []
            deltas.append(delta)
        out = {}
        for router_id, deltas in by_router.items():
            batch = self._batch.copy()
            batch["step"] = step
            batch["deltas"] = deltas
            out[router_id] = orjson.dumps(batch)
        return out, finished


class LoadDriverEngine(Service):
    """The load driver as a service (see the module docstring)."""

    service_kind = "engine"

    def __init__(self, config: LoadDriverConfig) -> None:
        super().__init__(config)
        self.config: LoadDriverConfig = config
        self.streams: dict[str, DriverStream] = {}
        self.encoder = StepEncoder(self.service_id, config.token_ids)
        self.num_steps = 0
        self.num_late_steps = 0  # steps that started more than one period late
        self.num_tokens = 0

    def role(self) -> str:
        return "colocated"

    async def on_start(self) -> None:
        subjects = self.bus.subjects
        await self.bus.subscribe(subjects.task(self.service_id), GenerateTask, self._on_task)
        await self.bus.subscribe(subjects.abort, Abort, self._on_abort)
        self.spawn(self._step_loop(), "step-loop")

    async def _on_task(self, task: GenerateTask, ctx: MsgContext) -> TaskAck:
        if self.status != "ready":
            err: OverloadedError | ServiceUnavailableError = ServiceUnavailableError("load driver draining")
        elif len(self.streams) >= self.config.max_running:
            err = OverloadedError(f"load driver runs {len(self.streams)} requests already")
        else:
            plan = task.plan
            self.streams[task.request_id] = DriverStream(
                request_id=task.request_id,
                router_id=plan.router_id,
                num_prompt_tokens=plan.num_prompt_tokens,
                max_tokens=plan.sampling.max_tokens,
            )
            return TaskAck(request_id=task.request_id, accepted=True)
        return TaskAck(request_id=task.request_id, accepted=False, code=err.code, message=err.message)

    async def _on_abort(self, msg: Abort, ctx: MsgContext) -> None:
        self.streams.pop(msg.request_id, None)

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        period_s = 1.0 / self.config.step_hz
        next_at = loop.time()
        while True:
            next_at += period_s
            delay_s = next_at - loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            elif delay_s < -period_s:  # fell behind: keep the rate, do not burst to catch up
                self.num_late_steps += 1
                next_at = loop.time()
            if self.streams:
                await self._step()

    async def _step(self) -> None:
        self.num_steps += 1
        self.num_tokens += len(self.streams)
        batches, finished = self.encoder.step(self.streams.values(), self.num_steps)
        for request_id in finished:
            del self.streams[request_id]
        for router_id, data in batches.items():
            await self.bus.publish_bytes(self.bus.subjects.tokens(router_id), data)

    def load_report(self, seq: int) -> LoadReport | None:
        return LoadReport(
            service_id=self.service_id,
            role="colocated",
            node=self.config.node,
            seq=seq,
            sent_at=time.time(),
            num_running=len(self.streams),
            unfinished_tokens=sum(s.max_tokens - s.num_sent for s in self.streams.values()),
            free_kv_blocks=self.config.total_kv_blocks,
            total_kv_blocks=self.config.total_kv_blocks,
            is_draining=self.status != "ready",
            kv_format=DRIVER_KV_FORMAT,
        )

    def health(self) -> dict[str, Any]:
        details = super().health()
        details.update(
            num_running=len(self.streams),
            num_steps=self.num_steps,
            num_late_steps=self.num_late_steps,
            num_tokens=self.num_tokens,
        )
        return details


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(
        argv, name="bench-engine", config_cls=LoadDriverConfig, build=LoadDriverEngine, description=__doc__
    )


if __name__ == "__main__":
    sys.exit(main())

"""Router service: the OpenAI HTTP API, the engine view fed by load reports, token streams from engines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from gpu.grammar import GrammarCompiler
from services.router import handlers
from services.router.api import (
    ApiContext,
    add_api_routes,
    body_limit_middleware,
    body_read_middleware,
    shutting_down,
)
from services.router.auth import ApiKeys
from services.router.bus_probe import BusProbe
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.orphans import OrphanAborts
from services.router.resend import StreamResends
from shared import telemetry
from shared.protocol import ServiceInfo
from shared.service import Service

log = logging.getLogger(__name__)


class RouterService(Service):
    service_kind = "router"
    http_handler_cancellation = True  # a client that disconnects cancels its handler: the request aborts

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.config: RouterConfig = config
        from gpu.model_spec import load_model_spec
        from gpu.tokenizer import load_tokenizer

        self.spec = load_model_spec(config.model, config.model_cache_dir or None)
        self.tokenizer = load_tokenizer(self.spec.model_dir)
        _ = self.tokenizer.max_token_bytes  # computed once (~40 ms per 50k tokens), not in a first request
        self.model_name = config.served_model_name or self.spec.name
        # the KV format (fingerprint, block size) comes from the engines' load reports, never from here
        self.core = RouterCore(config, self.bus, self.service_id)
        self.resends = StreamResends(self.bus, self.core.streams, config.stream_probe_s, self.spawn)
        self.bus_probe = BusProbe(self.bus, self.service_id)

    def new_app(self) -> web.Application:
        keys = ApiKeys.load(self.config.api_keys, self.config.api_key_file)
        if not keys.enabled:
            log.warning("no API key configured: the OpenAI API is open to whoever reaches its port")
        return web.Application(
            client_max_size=self.config.max_request_bytes,
            middlewares=[
                body_limit_middleware(self.config.max_request_bytes),
                keys.middleware(),
                body_read_middleware(self.config.request_read_timeout_s),
            ],
        )

    def add_routes(self, app: web.Application) -> None:
        telemetry.install_http_tracing(app)  # HTTP request and stream spans, only while tracing is on
        add_api_routes(
            app,
            ApiContext(
                core=self.core,
                tokenizer=self.tokenizer,
                model_name=self.model_name,
                max_model_len=self.spec.max_model_len,
                vocab_size=self.spec.vocab_size,
                max_tokens_limit=self.config.max_tokens_limit,
                retry_after_s=self.config.retry_after_s,
                stream_write_timeout_s=self.config.stream_write_timeout_s,
                created=int(self.started_at),
                grammars=GrammarCompiler(self.tokenizer),
            ),
        )

    async def on_start(self) -> None:
        subjects = self.bus.subjects
        await self.bus.subscribe_raw(
            subjects.tokens(self.service_id), handlers.token_batch_handler(self.core, OrphanAborts(self.bus))
        )
        await self.bus.subscribe_raw(subjects.load_all, handlers.load_report_handler(self.core))
        await self.bus_probe.start()
        self.spawn(self._watch_engines(), "watch-engines")
        self.spawn(self.core.dispatch.run(), "dispatch")

    async def _watch_engines(self) -> None:
        period = min(0.5, self.config.engine_silence_timeout_s / 3)
        while True:
            await asyncio.sleep(period)
            await self._check_bus(timeout_s=self.config.engine_silence_timeout_s / 3)
            self.resends.tick(time.monotonic())  # token batches NATS lost, before their gaps expire
            self.core.fail_silent_engines()

    async def _check_bus(self, timeout_s: float) -> None:
        """A bus that carries nothing (`bus_probe.py`) puts the engines' silence on hold, else every stream
        of every engine would fail as the engines' deaths, while they decode on. A third of the silence
        timeout, after a period of at most another third: an outage is noticed before any engine's silence
        is, and a loaded router's late echo is not taken for one."""
        if await self.bus_probe.round_trip(timeout_s):
            self.core.engines.bus_up(time.monotonic())
        else:
            self.core.engines.bus_down(time.monotonic())

    def begin_drain(self) -> None:
        self.core.draining = True  # the API refuses new requests from the moment health turns 503

    async def on_drain(self, deadline: float) -> None:
        """New requests are refused (`begin_drain`: 503, Retry-After; health and readiness 503 too); open
        streams finish; those still open a moment before the deadline end with a `service_unavailable`
        error event and `[DONE]`, their requests aborted on the engines while the bus still carries the
        aborts. Before, they ran on past the deadline with the bus closed under them, their clients waiting
        on nothing until the HTTP server's own shutdown timeout cancelled them (2 min after a SIGTERM under
        an agent mix)."""
        end_at = deadline - min(1.0, (deadline - time.monotonic()) / 4)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.core.is_idle.wait(), max(0.0, end_at - time.monotonic()))
        if self.core.is_idle.is_set():
            return
        ended = self.core.streams.end_all(shutting_down())
        log.warning("drain deadline: %d streams still open end with an error", ended)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.core.is_idle.wait(), max(0.0, deadline - time.monotonic()))

    def health(self) -> dict[str, Any]:
        details = super().health()
        engines = self.core.engines
        block_size = engines.kv_format.block_size if engines.kv_format is not None else 1
        details["engines"] = len(engines.engine_snapshots(block_size))
        if engines.refused:
            details["refused_engines"] = dict(engines.refused)
        details["inflight"] = self.core.inflight
        return details

    def readiness(self) -> dict[str, Any]:
        """Ready when healthy and at least one engine reports load: until then every request would be 503."""
        details = self.health()
        if details["ok"] and not details["engines"]:
            details["ok"], details["reason"] = False, "no engine"
        return details

    def service_info(self) -> ServiceInfo:
        info = super().service_info()
        info.model = self.model_name
        return info

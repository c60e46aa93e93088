"""Service base: lifecycle, HTTP health/metrics, registry heartbeat, periodic load report, graceful drain.

Every kvpath service is a `Service` subclass that fills in a few hooks:
  `on_start()`  subscribe to its subjects (the base flushes, then announces the service as ready);
  `on_drain(deadline)`  finish in-flight work before `deadline` (monotonic seconds) on SIGTERM;
  `on_stop()`  release what it owns (shared memory, files, threads);
  `load_report(seq)`  the load report to publish (None: the service publishes none);
  `add_routes(app)`  extra HTTP routes (the router's API).
`start()` and `stop()` are idempotent; signal handlers only set an event.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from aiohttp import web
from prometheus_client import Gauge

from shared import telemetry
from shared.bus import Bus, Registry
from shared.bus_auth import NatsAuth
from shared.config import BaseConfig, add_config_args, config_from_args
from shared.errors import KvpathError
from shared.limits import raise_open_files_limit
from shared.logs import setup_logging
from shared.protocol import LoadReport, ServiceInfo

log = logging.getLogger(__name__)

GC_FROZEN = Gauge(
    "kvpath_process_gc_frozen_objects",
    "Objects the process made while starting, frozen out of garbage collection once ready",
)
GC_FROZEN.set_function(gc.get_freeze_count)

C = TypeVar("C", bound=BaseConfig)


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


class Service:
    service_kind: ClassVar[str] = "service"
    http_handler_cancellation: ClassVar[bool] = False

    def __init__(self, config: BaseConfig) -> None:
        self.config = config
        self.service_id = config.service_id or f"{self.service_kind}-{config.node}-{uuid.uuid4().hex[:8]}"
        self.bus = Bus(
            config.nats_url,
            config.namespace,
            name=self.service_id,
            request_timeout_s=config.request_timeout_s,
            auth=NatsAuth.from_config(config),
            jetstream_replicas=config.jetstream_replicas,
        )
        self.registry: Registry[ServiceInfo] = Registry(self.bus, config.registry_ttl_s)
        self.status = "starting"
        self.started_at = time.time()
        self.http_url = ""
        self._stop_requested = asyncio.Event()
        self._report_now = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None
        self._started = False
        self._stopped = False
        self._load_seq = 0

    # ------------------------------------------------------------------------------------------ hooks

    async def on_start(self) -> None:
        """Subscribe to subjects and build state. Called once, after the bus connects."""

    def begin_drain(self) -> None:
        """Refuse new work from now on: called once on stop, as health turns 503, before any await."""

    async def on_drain(self, deadline: float) -> None:
        """Finish in-flight work before `deadline` (time.monotonic()). Called once on stop."""

    async def on_stop(self) -> None:
        """Release resources. Called once, after draining, before the bus closes."""

    def load_report(self, seq: int) -> LoadReport | None:
        """The load report to publish now, or None for services that publish none."""
        return None

    def role(self) -> str:
        return ""

    def service_info(self) -> ServiceInfo:
        return ServiceInfo(
            service_id=self.service_id,
            service_kind=self.service_kind,
            role=self.role(),
            node=self.config.node,
            status=self.status,
            http_url=self.http_url,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
        )

    def health(self) -> dict[str, Any]:
        """Health details; `ok` false makes /health answer 503 (liveness: restart me)."""
        return {"ok": self.status == "ready" and self.bus.is_connected.is_set(), "status": self.status}

    def readiness(self) -> dict[str, Any]:
        """Readiness details; `ok` false makes /ready answer 503 (send me no traffic now). Healthy by default;
        a service that cannot serve without others (the router without engines) says so here."""
        return self.health()

    def add_routes(self, app: web.Application) -> None:
        """Add service-specific HTTP routes next to /health and /metrics."""

    # -------------------------------------------------------------------------------------- lifecycle

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start a task the service owns: it is cancelled and awaited on stop."""
        task = asyncio.create_task(coro, name=f"{self.service_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "task failed service=%s task=%s", self.service_id, task.get_name(), exc_info=task.exception()
            )

    def request_stop(self) -> None:
        self._stop_requested.set()

    def report_load_now(self) -> None:
        """Publish a load report at the next opportunity (on change)."""
        self._report_now.set()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        telemetry.setup_tracing(f"kvpath-{self.service_kind}", service_instance=self.service_id)
        await self.bus.connect(timeout_s=max(5.0, self.config.request_timeout_s))
        await self.registry.open()
        await self._start_http()
        await self.on_start()
        await self.bus.flush()
        self.status = "ready"
        await self.registry.put(self.service_info())
        self.spawn(self._heartbeat_loop(), "heartbeat")
        self.spawn(self._load_loop(), "load-report")
        log.info("service ready id=%s kind=%s http=%s", self.service_id, self.service_kind, self.http_url)

    async def stop(self) -> None:
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        self.status = "draining"
        self.begin_drain()
        deadline = time.monotonic() + self.config.drain_timeout_s
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.registry.put(self.service_info()), 1.0)
        self.report_load_now()
        try:
            await asyncio.wait_for(self.on_drain(deadline), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            log.warning("drain deadline passed service=%s", self.service_id)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.registry.remove(self.service_id), 1.0)
        await cancel_and_wait(self._tasks)
        try:
            await self.on_stop()
        finally:
            if self._runner is not None:  # before the bus: a handler it cancels may still publish (an abort)
                await self._runner.cleanup()
            await self.bus.close(timeout_s=max(0.5, deadline - time.monotonic()))
        log.info("service stopped id=%s", self.service_id)

    async def run(self, when_ready: Callable[[], None] | None = None) -> None:
        """Start, serve until SIGTERM/SIGINT, then drain and stop; `when_ready()` once started."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            if when_ready is not None:
                when_ready()
            await self._stop_requested.wait()
        finally:
            await self.stop()

    # ----------------------------------------------------------------------------------------- loops

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            try:
                await asyncio.wait_for(self.registry.put(self.service_info()), self.config.request_timeout_s)
            except Exception as exc:  # keep beating through NATS outages
                log.warning("heartbeat failed service=%s: %r", self.service_id, exc)

    async def _load_loop(self) -> None:
        subject = self.bus.subjects.load(self.role() or self.service_kind, self.service_id)
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report_now.wait(), self.config.load_report_interval_s)
            self._report_now.clear()
            self._load_seq += 1
            report = self.load_report(self._load_seq)
            if report is None:
                continue
            report.incarnation_unix_s = self.started_at
            try:
                await self.bus.publish(subject, report)
            except Exception as exc:
                log.warning("load report failed service=%s: %r", self.service_id, exc)

    # ------------------------------------------------------------------------------------------ http

    def new_app(self) -> web.Application:
        """The HTTP application (a service with other limits or middlewares makes its own)."""
        return web.Application()

    def build_app(self) -> web.Application:
        app = self.new_app()
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/ready", self._handle_ready)
        app.router.add_get("/metrics", self._handle_metrics)
        self.add_routes(app)
        return app

    async def _start_http(self) -> None:
        app = self.build_app()
        # a handler still running when the server stops (past `on_drain`) is cancelled after a second
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=self.http_handler_cancellation,
            shutdown_timeout=1.0,
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.config.http_host,
            self.config.http_port,
            reuse_address=True,
            backlog=self.config.http_backlog,
        )
        await site.start()
        port = self.config.http_port
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            port = server.sockets[0].getsockname()[1]
        self.http_url = f"http://{self.advertised_host()}:{port}"

    def advertised_host(self) -> str:
        """The host name peers should use: configured, else the bind address unless it is a wildcard."""
        if self.config.advertise_host:
            return self.config.advertise_host
        if self.config.http_host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.config.http_host

    async def _handle_health(self, request: web.Request) -> web.Response:
        details = self.health()
        details["service_id"] = self.service_id
        return web.json_response(details, status=200 if details.get("ok") else 503)

    async def _handle_ready(self, request: web.Request) -> web.Response:
        details = self.readiness()
        details["service_id"] = self.service_id
        return web.json_response(details, status=200 if details.get("ok") else 503)

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=telemetry.metrics_text(service_kind=self.service_kind),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )


async def cancel_and_wait(tasks: set[asyncio.Task[Any]], grace_s: float = 0.5) -> None:
    """Cancel every task and wait until each has ended, cancelling again one still running after `grace_s`:
    on Python 3.11 `asyncio.wait_for` drops a cancellation that lands as its inner future completes (fixed
    in 3.12), and a task looping on it (the index's event feed, a fetch per 0.5 s) then runs on, so that
    `stop()` hung until `kvpath up` killed the service 15 s later."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace_s)


def freeze_startup_heap() -> None:
    """Keep the garbage collector off the objects a started service keeps for life, then turn it on.

    A service's imports (torch's most of all) and start (a model's load) leave ~200k objects in an engine,
    ~60k in a router, that stay until the process exits. With the collector on during startup, each time
    they grew by a quarter a full collection walked them all: 0.1-0.3 s of an engine's start went there.
    Frozen, later collections walk only what serving creates. Whatever cyclic garbage startup left is frozen
    with them (measured below a megabyte: README "Tests").
    """
    gc.freeze()
    gc.enable()


def serve_main(
    argv: Sequence[str] | None,
    *,
    name: str,
    config_cls: type[C],
    build: Callable[[C], Service],
    description: str | None = None,
) -> int:
    """The body of every `services/<name>/__main__.py`: flags + YAML + env -> config, logging, run."""
    parser = argparse.ArgumentParser(prog=f"kvpath serve {name}", description=description)
    parser.add_argument("--config", help=f"YAML config file (sections: common, {name})")
    add_config_args(parser, config_cls)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(config_cls, args, section=name)
    except KvpathError as exc:
        print(f"kvpath serve {name}: {exc.message}", file=sys.stderr)
        return 2
    gc.disable()  # until the service is ready: `freeze_startup_heap`
    raise_open_files_limit()
    setup_logging(name, level=config.log_level, as_json=config.log_json)
    install_uvloop()
    try:
        asyncio.run(build(config).run(when_ready=freeze_startup_heap))
    except KvpathError as exc:
        log.error("%s failed to start: %s", name, exc.message)
        return 1
    finally:
        # the process exits next: spare it the interpreter's last garbage collection over every object still
        # alive (torch's made it 0.35 s of each engine's stop); the memory goes back with the process anyway
        gc.freeze()
    return 0

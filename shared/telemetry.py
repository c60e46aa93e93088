"""Tracing (OpenTelemetry) and metrics (Prometheus) shared by every service.

Tracing is off unless `setup_tracing` installs an SDK provider: it does so when `OTEL_EXPORTER_OTLP_ENDPOINT`
is set (OTLP over HTTP, batched in a background thread), when `KVPATH_TRACE_DIR` is set (test and debug
only: every process appends its finished spans as JSON lines to `<dir>/<service>-<pid>.jsonl`), or when a
test passes its own exporter. While it is off, `span()` returns one shared no-op context manager,
`start_span()` returns None and header injection returns its input: no SDK call, no allocation. Callers
on hot paths build attribute dicts only when `tracing_enabled()`.

Trace context crosses services in NATS message headers (W3C `traceparent`, see `shared.bus`) and arrives
at the router in HTTP headers, so one request is one trace. Span names and attributes: docs/observability.md.
Sampling follows the SDK's `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default: every request).
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, generate_latest

log = logging.getLogger(__name__)

TRACE_DIR_ENV = "KVPATH_TRACE_DIR"
_TRACER_NAME = "kvpath"

_enabled = False
_env_configured = False
_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider while tracing is on
_tracer: Any = None


class _NoSpan:
    """What `span()` returns while tracing is off: enters to None, costs one method call each way."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NO_SPAN = _NoSpan()


# ------------------------------------------------------------------------------------------- setup


def setup_tracing(service_name: str, *, exporter: Any = None, service_instance: str = "") -> bool:
    """Turn tracing on when the environment asks for it or `exporter` is given; return whether it is on.

    Idempotent for the environment's exporters (each process configures them once). `exporter` (tests):
    a SpanExporter fed by a simple (synchronous) processor.
    """
    global _enabled, _env_configured
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    trace_dir = os.environ.get(TRACE_DIR_ENV, "")
    from_env = not _env_configured and bool(endpoint or trace_dir)
    if exporter is None and not from_env:
        return _enabled
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = _install_provider(service_name, service_instance)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if from_env:
        _env_configured = True
        if endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            log.info("tracing on: OTLP endpoint=%s service=%s", endpoint, service_name)
        if trace_dir:
            path = Path(trace_dir) / f"{service_name}-{os.getpid()}.jsonl"
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))  # type: ignore[arg-type]
            log.info("tracing on: span file=%s", path)
    _enabled = True
    return True


def _install_provider(service_name: str, service_instance: str) -> Any:
    global _provider, _tracer
    if _provider is None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        attributes = {"service.name": service_name}
        attributes["service.instance.id"] = service_instance or f"{socket.gethostname()}:{os.getpid()}"
        # not the global provider: tests turn tracing on and off (`shutdown_tracing`) within one process
        _provider = TracerProvider(resource=Resource.create(attributes))
        _tracer = _provider.get_tracer(_TRACER_NAME)
    return _provider


def shutdown_tracing() -> None:
    """Flush and drop the provider: tracing is off again (tests; at exit the SDK flushes by itself)."""
    global _enabled, _env_configured, _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    _enabled = _env_configured = False
    if provider is not None:
        provider.shutdown()


def force_flush(timeout_s: float = 5.0) -> bool:
    """Export every finished span now (blocking; run it in a thread from async code)."""
    return bool(_provider.force_flush(int(timeout_s * 1000))) if _provider is not None else True


def tracing_enabled() -> bool:
    return _enabled


# --------------------------------------------------------------------------------- spans and context


def span(
    name: str, *, parent: otel_context.Context | None = None, attributes: Mapping[str, Any] | None = None
) -> AbstractContextManager[Any]:
    """A span for a pipeline stage, current while the block runs (bus messages sent in it carry it).

    `parent` None: the current span. Enters to the span, or to None while tracing is off. An exception
    leaving the block is recorded and marks the span as an error.
    """
    if not _enabled:
        return NO_SPAN
    return _tracer.start_as_current_span(name, context=parent, attributes=attributes)  # type: ignore[no-any-return]


def start_span(
    name: str, *, parent: otel_context.Context | None = None, attributes: Mapping[str, Any] | None = None
) -> Any:
    """A span that outlives the current block (ended by `end_span`), not made current; None when off."""
    if not _enabled:
        return None
    return _tracer.start_span(name, context=parent, attributes=attributes)


def end_span(s: Any, *, error: str = "", attributes: Mapping[str, Any] | None = None) -> None:
    """End a span from `start_span` (None is ignored); a non-empty `error` marks it failed."""
    if s is None:
        return
    if attributes:
        s.set_attributes(attributes)
    if error:
        s.set_status(Status(StatusCode.ERROR, error))
    s.end()


def set_current_attribute(key: str, value: Any) -> None:
    """Set an attribute on the current span (no-op while tracing is off or outside any span)."""
    if _enabled:
        trace.get_current_span().set_attribute(key, value)


def set_current_error(message: str) -> None:
    """Mark the current span failed (for errors handled inside it, which its block never sees)."""
    if _enabled:
        trace.get_current_span().set_status(Status(StatusCode.ERROR, message))


def current_context() -> otel_context.Context | None:
    return otel_context.get_current() if _enabled else None


def context_of(s: Any) -> otel_context.Context | None:
    """A context whose current span is `s` (to parent spans started elsewhere on it); None for None."""
    return trace.set_span_in_context(s) if s is not None else None


class _Attached:
    __slots__ = ("_parent", "_token")

    def __init__(self, parent: otel_context.Context) -> None:
        self._parent = parent
        self._token: object = None

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._parent)

    def __exit__(self, *exc: object) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]


def attached(parent: otel_context.Context | None) -> AbstractContextManager[None]:
    """Make a received context current for a block, so spans, bus messages and tasks started in it
    continue that trace. No-op for None (tracing off or nothing received)."""
    return NO_SPAN if parent is None else _Attached(parent)


def task_context(parent: otel_context.Context | None) -> contextvars.Context | None:
    """A context for `asyncio.create_task(..., context=)` whose current span is `parent` (None: default)."""
    if parent is None:
        return None
    ctx = contextvars.copy_context()
    ctx.run(otel_context.attach, parent)
    return ctx


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """Trace-context headers for an outgoing bus message (the input itself while tracing is off)."""
    if not _enabled:
        return headers
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier or None


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    if not _enabled or not headers:
        return None
    return propagate.extract(headers)


# ------------------------------------------------------------------------------------------- HTTP

_HTTP_SPAN = web.RequestKey("kvpath_http_span", object)
_STREAM_SPAN = web.RequestKey("kvpath_stream_span", object)
UNTRACED_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes: no trace each


def install_http_tracing(app: web.Application) -> bool:
    """While tracing is on: a SERVER span per HTTP request (continuing a client's `traceparent`), and
    for streamed responses a `stream` span from the first byte (headers sent) to the last. Call before
    the app starts; returns whether anything was installed (nothing at all while tracing is off).
    Requests for `UNTRACED_PATHS` pass through untraced."""
    if not _enabled:
        return False
    app.middlewares.append(_http_span_middleware)
    app.on_response_prepare.append(_start_stream_span)
    return True


@web.middleware
async def _http_span_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path in UNTRACED_PATHS:
        return await handler(request)  # type: ignore[no-any-return]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    attributes = {"http.request.method": request.method, "http.route": route, "url.path": request.path}
    parent = propagate.extract(request.headers)
    with _tracer.start_as_current_span(
        f"{request.method} {route}", context=parent, kind=SpanKind.SERVER, attributes=attributes
    ) as s:
        request[_HTTP_SPAN] = s
        try:
            response: web.StreamResponse = await handler(request)
        finally:
            end_span(request.pop(_STREAM_SPAN, None))
            request.pop(_HTTP_SPAN, None)
        s.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            s.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
        return response


async def _start_stream_span(request: web.Request, response: web.StreamResponse) -> None:
    http_span = request.get(_HTTP_SPAN)
    # a plain Response is prepared after the handler returned: only streamed bodies get a stream span
    if http_span is not None and not isinstance(response, web.Response):
        request[_STREAM_SPAN] = _tracer.start_span("stream", context=trace.set_span_in_context(http_span))


# ------------------------------------------------------------------------------------- span files


class JsonLinesSpanExporter:
    """Test/debug exporter: one JSON object per finished span, appended to a file (see read_span_files)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # closed by shutdown()

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self._file.closed:
            return SpanExportResult.FAILURE
        self._file.write(b"".join(orjson.dumps(span_record(s), default=str) + b"\n" for s in spans))
        self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        self._file.close()


def span_record(s: Any) -> dict[str, Any]:
    """A finished SDK span as plain data: ids in hex, times in ns, the service from its resource."""
    ctx = s.get_span_context()
    return {
        "name": s.name,
        "service": s.resource.attributes.get("service.name", ""),
        "instance": s.resource.attributes.get("service.instance.id", ""),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{s.parent.span_id:016x}" if s.parent is not None else "",
        "kind": s.kind.name,
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "status": s.status.status_code.name,
        "attributes": dict(s.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in s.events],
    }


def read_span_files(trace_dir: str | Path) -> list[dict[str, Any]]:
    """Every span the processes wrote under `trace_dir` (a partly written last line is skipped)."""
    out = []
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return out


# ------------------------------------------------------------------------------------------- metrics


SERVICE_KINDS = ("router", "engine", "storage", "index", "remotekv", "cxlpool")  # each owns kvpath_<kind>_*


class _OwnMetrics:
    """A registry's families less those of other kinds of service. `kvpath up` forks every service from
    one process that imported them all, so each inherits every service's metrics (as zeros): an engine's
    /metrics listed 29 kvpath_router_* families, which an avg() or an alert over all targets reads."""

    def __init__(self, registry: CollectorRegistry, service_kind: str) -> None:
        self.registry = registry
        self.foreign = tuple(f"kvpath_{kind}_" for kind in SERVICE_KINDS if kind != service_kind)

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            if not family.name.startswith(self.foreign):
                yield family


def metrics_text(registry: CollectorRegistry = DEFAULT_REGISTRY, service_kind: str = "") -> bytes:
    """The exposition text; with `service_kind`, without other kinds of service's families."""
    return generate_latest(_OwnMetrics(registry, service_kind) if service_kind else registry)  # type: ignore[arg-type]


BUS_MESSAGES = Counter(
    "kvpath_bus_messages_total", "Bus messages by direction (in/out) and subject kind", ["direction", "kind"]
)
BUS_ERRORS = Counter(
    "kvpath_bus_errors_total",
    "Bus errors by kind (malformed, handler, timeout, lost: a request given up after a disconnect)",
    ["kind"],
)

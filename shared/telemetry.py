"""Tracing (OpenTelemetry) and metrics (Prometheus) shared by every service.

Tracing costs nothing beyond no-op calls unless `setup_tracing` installs an SDK provider: it does so when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set (OTLP over HTTP) or when a test passes its own exporter. Trace context
crosses services in NATS message headers (W3C `traceparent`), so one request is one trace.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, generate_latest

log = logging.getLogger(__name__)

_TRACER_NAME = "kvpath"
_provider_installed = False


def setup_tracing(service_name: str, *, exporter: Any = None) -> bool:
    """Install an SDK tracer provider when tracing is asked for; return whether tracing is on.

    `exporter` (tests): a SpanExporter to use with a simple processor instead of OTLP.
    """
    global _provider_installed
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter is None and not endpoint:
        return _provider_installed
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        provider = current
    else:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        trace.set_tracer_provider(provider)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("tracing on: OTLP endpoint=%s service=%s", endpoint, service_name)
    _provider_installed = True
    return True


def tracing_enabled() -> bool:
    return _provider_installed


def tracer() -> trace.Tracer:
    return trace.get_tracer(_TRACER_NAME)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """Trace-context headers for an outgoing bus message (None when tracing is off: no cost)."""
    if not _provider_installed:
        return headers
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier or None


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    if not _provider_installed or not headers:
        return None
    return propagate.extract(dict(headers))


@contextmanager
def span(name: str, *, parent: otel_context.Context | None = None, **attributes: Any) -> Iterator[Any]:
    """A span named after a pipeline stage; a no-op (no SDK calls) while tracing is off."""
    if not _provider_installed:
        yield None
        return
    with tracer().start_as_current_span(name, context=parent, attributes=attributes or None) as s:
        yield s


# ------------------------------------------------------------------------------------------- metrics


def metrics_text(registry: CollectorRegistry = DEFAULT_REGISTRY) -> bytes:
    return generate_latest(registry)


BUS_MESSAGES = Counter(
    "kvpath_bus_messages_total", "Bus messages by direction (in/out) and subject kind", ["direction", "kind"]
)
BUS_ERRORS = Counter("kvpath_bus_errors_total", "Bus errors by kind (malformed, handler, timeout)", ["kind"])

"""shared.telemetry: no-ops while off, span nesting, context over NATS headers and HTTP, the exporters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import telemetry
from shared.bus import Bus, MsgContext
from shared.natsserver import NatsServer
from shared.protocol import Ack, Message


@pytest.fixture(autouse=True)
def no_tracing_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts and ends with tracing off and no tracing variables set."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv(telemetry.TRACE_DIR_ENV, raising=False)
    telemetry.shutdown_tracing()
    yield
    telemetry.shutdown_tracing()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    assert telemetry.setup_tracing("kvpath-test", exporter=exporter)
    return exporter


def by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_everything_is_a_no_op_while_tracing_is_off() -> None:
    assert not telemetry.setup_tracing("kvpath-test")  # no endpoint, no exporter: stays off
    assert not telemetry.tracing_enabled()
    with telemetry.span("x", attributes={"a": 1}) as s:
        assert s is None
    assert telemetry.span("y") is telemetry.NO_SPAN  # one shared object: nothing allocated per call
    assert telemetry.start_span("z") is None
    telemetry.end_span(None, error="ignored")
    headers = {"k": "v"}
    assert telemetry.inject_headers(headers) is headers
    assert telemetry.inject_headers(None) is None
    assert telemetry.extract_context({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    assert telemetry.current_context() is None
    assert telemetry.task_context(None) is None
    with telemetry.attached(None):
        pass
    app = web.Application()
    assert not telemetry.install_http_tracing(app)
    assert len(app.middlewares) == 0


def test_spans_nest_and_errors_are_recorded(spans: InMemorySpanExporter) -> None:
    with telemetry.span("outer", attributes={"request_id": "r1"}) as outer:
        assert outer is not None
        with telemetry.span("inner"):
            pass
        long = telemetry.start_span("long")
    telemetry.end_span(long, error="boom", attributes={"bytes": 7})
    with pytest.raises(ValueError), telemetry.span("failing"):
        raise ValueError("bad")
    got = by_name(spans)
    trace_id = got["outer"].context.trace_id
    assert {s.context.trace_id for s in got.values() if s.name != "failing"} == {trace_id}
    assert got["inner"].parent.span_id == got["outer"].context.span_id
    assert got["long"].parent.span_id == got["outer"].context.span_id
    assert got["long"].attributes["bytes"] == 7 and got["long"].status.status_code.name == "ERROR"
    assert got["outer"].attributes["request_id"] == "r1"
    assert got["failing"].status.status_code.name == "ERROR"
    assert got["failing"].parent is None  # a new trace


def test_headers_carry_the_context_and_attached_makes_it_current(spans: InMemorySpanExporter) -> None:
    with telemetry.span("sender"):
        headers = telemetry.inject_headers({"x": "1"})
    assert headers is not None and headers["x"] == "1" and "traceparent" in headers
    parent = telemetry.extract_context(headers)
    with telemetry.attached(parent), telemetry.span("receiver"):
        pass
    context = telemetry.task_context(parent)
    assert context is not None
    context.run(lambda: telemetry.end_span(telemetry.start_span("in-task")))
    got = by_name(spans)
    for name in ("receiver", "in-task"):
        assert got[name].context.trace_id == got["sender"].context.trace_id
        assert got[name].parent.span_id == got["sender"].context.span_id


async def test_bus_requests_and_publishes_carry_the_trace(
    spans: InMemorySpanExporter, nats_server: NatsServer, namespace: str
) -> None:
    """shared.bus injects the current span into request and publish headers; MsgContext extracts it."""
    bus = Bus(nats_server.url, namespace, name="t")
    await bus.connect()
    published = asyncio.Event()

    async def handle(msg: Message, ctx: MsgContext) -> Ack:
        with telemetry.span(f"handled-{ctx.subject.rsplit('.', 1)[-1]}", parent=ctx.trace_parent):
            pass
        if ctx.subject.endswith("pub"):
            published.set()
        return Ack(detail="ok")

    try:
        await bus.subscribe(bus.subjects.prefix + ".req", Ack, handle)
        await bus.subscribe(bus.subjects.prefix + ".pub", Ack, handle)
        with telemetry.span("client"):
            await bus.request(bus.subjects.prefix + ".req", Ack(), Ack, timeout_s=5)
            await bus.publish(bus.subjects.prefix + ".pub", Ack())
        await asyncio.wait_for(published.wait(), 5)
    finally:
        await bus.close()
    got = by_name(spans)
    for name in ("handled-req", "handled-pub"):
        assert got[name].context.trace_id == got["client"].context.trace_id
        assert got[name].parent.span_id == got["client"].context.span_id


@pytest.fixture
async def http_app(spans: InMemorySpanExporter) -> AsyncIterator[str]:
    async def streamed(request: web.Request) -> web.StreamResponse:
        with telemetry.span("work"):
            pass
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"a")
        await response.write_eof()
        return response

    async def plain(request: web.Request) -> web.Response:
        return web.json_response({"ok": True}, status=503)

    app = web.Application()
    assert telemetry.install_http_tracing(app)
    app.router.add_post("/s", streamed)
    app.router.add_get("/p/{name}", plain)
    app.router.add_get("/health", plain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_http_requests_get_a_server_span_and_streams_a_stream_span(
    http_app: str, spans: InMemorySpanExporter
) -> None:
    client_trace = "ab" * 16
    traceparent = f"00-{client_trace}-{'cd' * 8}-01"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{http_app}/s", headers={"traceparent": traceparent}) as resp:
            assert await resp.read() == b"a"
        async with http.get(f"{http_app}/p/x") as resp:
            assert resp.status == 503
        async with http.get(f"{http_app}/health") as resp:
            assert resp.status == 503  # served, not traced
    finished = spans.get_finished_spans()
    server = {s.name: s for s in finished if s.kind.name == "SERVER"}
    assert set(server) == {"POST /s", "GET /p/{name}"}
    post = server["POST /s"]
    assert f"{post.context.trace_id:032x}" == client_trace  # the client's trace continues
    assert post.attributes["http.response.status_code"] == 200
    children = {
        s.name: s for s in finished if s.parent is not None and s.parent.span_id == post.context.span_id
    }
    assert set(children) == {"work", "stream"}
    assert children["stream"].start_time >= children["work"].end_time  # first byte after the work
    assert server["GET /p/{name}"].status.status_code.name == "ERROR"
    assert not any(s.name == "stream" and s.parent.span_id != post.context.span_id for s in finished)


def test_trace_dir_exporter_writes_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(telemetry.TRACE_DIR_ENV, str(tmp_path))
    assert telemetry.setup_tracing("kvpath-filetest")
    assert telemetry.setup_tracing("kvpath-filetest")  # idempotent: one exporter, not two
    with telemetry.span("parent", attributes={"request_id": "r9"}):
        with telemetry.span("child") as child:
            child.add_event("chunk", {"num_tokens": 3})
    records = {r["name"]: r for r in telemetry.read_span_files(tmp_path)}
    assert set(records) == {"parent", "child"}
    assert records["child"]["parent_id"] == records["parent"]["span_id"]
    assert records["child"]["trace_id"] == records["parent"]["trace_id"]
    assert records["parent"]["service"] == "kvpath-filetest"
    assert records["parent"]["attributes"] == {"request_id": "r9"}
    assert records["child"]["events"] == [{"name": "chunk", "attributes": {"num_tokens": 3}}]
    assert records["child"]["end_ns"] >= records["child"]["start_ns"] > 0


async def test_otlp_endpoint_receives_the_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT turns tracing on; spans arrive as OTLP/HTTP protobuf."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    names: list[str] = []

    async def traces(request: web.Request) -> web.Response:
        body = ExportTraceServiceRequest.FromString(await request.read())
        names.extend(s.name for rs in body.resource_spans for ss in rs.scope_spans for s in ss.spans)
        payload = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=payload, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{runner.addresses[0][1]}")
        assert telemetry.setup_tracing("kvpath-otlptest")
        with telemetry.span("exported"):
            pass
        assert await asyncio.to_thread(telemetry.force_flush, 10.0)
    finally:
        await runner.cleanup()
    assert names == ["exported"]

"""The bus wrapper against a real nats-server: typed request/reply, malformed input, registry TTL."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import nats.js.errors
import pytest

from shared.bus import Bus, MsgContext, Registry
from shared.errors import DeadlineExceededError, InvalidRequestError, ServiceUnavailableError
from shared.natsserver import NatsServer
from shared.protocol import Abort, Ack, ErrorReply, ServiceInfo, decode


async def _bus(server: NatsServer, namespace: str, name: str) -> Bus:
    bus = Bus(server.url, namespace, name=name, request_timeout_s=2.0)
    await bus.connect()
    return bus


async def test_request_reply_and_errors(nats_server: NatsServer, namespace: str) -> None:
    server_bus, client = await _bus(nats_server, namespace, "srv"), await _bus(nats_server, namespace, "cli")
    subject = server_bus.subjects.abort

    async def handler(msg: Abort, ctx: MsgContext) -> Ack:
        if msg.reason == "bad":
            raise InvalidRequestError("reason may not be bad", param="reason")
        return Ack(detail=msg.request_id)

    try:
        await server_bus.subscribe(subject, Abort, handler)
        await server_bus.flush()
        assert (await client.request(subject, Abort(request_id="r1"), Ack)).detail == "r1"
        with pytest.raises(InvalidRequestError, match="may not be bad"):
            await client.request(subject, Abort(request_id="r1", reason="bad"), Ack)
        # malformed payload: answered with an error, the subscription survives
        raw = await client.nc.request(subject, b'{"kind": "abort"}', timeout=2)
        err = decode(raw.data, ErrorReply)
        assert err.code == "bad_message" and "unsupported version" in err.message
        assert (await client.request(subject, Abort(request_id="r2"), Ack)).detail == "r2"
        with pytest.raises(ServiceUnavailableError):
            await client.request(server_bus.subjects.task("nobody"), Abort(request_id="x"), Ack)
    finally:
        await server_bus.close()
        await client.close()


async def test_flush_follows_the_subscription(nats_server: NatsServer, namespace: str) -> None:
    """nats-py writes flush()'s PING ahead of a SUB still queued for its flusher task; Bus.flush must not, or
    a request from another connection sent on the PONG can meet no responders. A recording TCP proxy between
    the bus and the real server shows the order the server reads."""
    sent = bytearray()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if record:
                    sent.extend(data)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def on_client(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_reader, s_writer = await asyncio.open_connection(nats_server.host, nats_server.port)
        await asyncio.gather(pipe(c_reader, s_writer, True), pipe(s_reader, c_writer, False))

    proxy = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = proxy.sockets[0].getsockname()[1]
    bus = Bus(f"nats://127.0.0.1:{port}", namespace, name="ordered")
    try:
        await bus.connect()
        start = len(sent)
        await bus.subscribe(bus.subjects.abort, Abort, lambda msg, ctx: asyncio.sleep(0))
        await bus.flush()
        after = bytes(sent[start:])
        assert b"SUB " in after and b"PING" in after, after
        assert after.index(b"SUB ") < after.rindex(b"PING"), f"PING sent before the SUB: {after!r}"
    finally:
        await bus.close()
        proxy.close()
        await proxy.wait_closed()


async def test_request_deadline(nats_server: NatsServer, namespace: str) -> None:
    server_bus, client = await _bus(nats_server, namespace, "srv"), await _bus(nats_server, namespace, "cli")
    release = asyncio.Event()

    async def slow(msg: Abort, ctx: MsgContext) -> Ack:
        await release.wait()
        return Ack()

    try:
        await server_bus.subscribe(server_bus.subjects.abort, Abort, slow, max_concurrency=4)
        await server_bus.flush()
        with pytest.raises(DeadlineExceededError):
            await client.request(server_bus.subjects.abort, Abort(request_id="r"), Ack, timeout_s=0.2)
    finally:  # a failure here must not leave connections open for a later test's garbage collection
        release.set()
        await server_bus.close()
        await client.close()


async def test_registry_expires_entries(nats_server: NatsServer, namespace: str) -> None:
    bus = await _bus(nats_server, namespace, "reg")
    registry: Registry[ServiceInfo] = Registry(bus, ttl_s=1.0)
    await registry.open()
    await registry.put(ServiceInfo(service_id="engine-1", service_kind="engine", status="ready"))
    assert [s.service_id for s in await registry.list()] == ["engine-1"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while await registry.list():
        assert loop.time() < deadline, "registry entry did not expire"
        await asyncio.sleep(0.1)
    await bus.close()


async def test_message_over_the_bus_limit_is_a_clear_error(nats_server: NatsServer, namespace: str) -> None:
    bus = await _bus(nats_server, namespace, "big")
    huge = Abort(request_id="x" * (bus.max_payload + 1))
    with pytest.raises(InvalidRequestError, match="exceeds the bus limit"):
        await bus.request(bus.subjects.abort, huge, Ack, timeout_s=1)
    with pytest.raises(InvalidRequestError, match="exceeds the bus limit"):
        await bus.publish(bus.subjects.abort, huge)
    await bus.close()


async def test_a_registry_write_waits_out_a_stream_without_a_leader(
    nats_server: NatsServer, namespace: str
) -> None:
    """A replicated bucket answers "no response from stream" until its replicas elect a leader (seen when
    services start within a second of a 3-server cluster). The bucket's first two answers are that error
    (a stand-in for the election, named as such: one server cannot cause it), then the real one."""
    bus = await _bus(nats_server, namespace, "settle")
    registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
    await registry.open()
    real_put, refusals = registry.kv.put, []

    async def electing_put(key: str, value: bytes) -> int:
        if len(refusals) < 2:
            refusals.append(key)
            raise nats.js.errors.NoStreamResponseError
        return await real_put(key, value)

    registry.kv.put = electing_put  # type: ignore[method-assign]
    await registry.put(ServiceInfo(service_id="router-0", service_kind="router", status="ready"))
    assert refusals == ["router-0", "router-0"]
    assert [s.service_id for s in await registry.list()] == ["router-0"]
    refusals.clear()
    with pytest.raises(nats.js.errors.NoStreamResponseError):  # past the settle time: the error, not a hang
        await registry.put(ServiceInfo(service_id="router-1", service_kind="router"), settle_s=0.0)
    await bus.close()


async def test_a_request_in_flight_when_the_server_dies_fails_soon_not_at_its_deadline(
    tmp_path: Path, namespace: str
) -> None:
    """Core NATS request/reply is at most once: a request whose server dies before it is answered may never
    be. It fails as unavailable the grace after the disconnect (10 s by default; 0.5 s here) instead of
    waiting out its timeout (a KV read's is the whole request's, 600 s), and the bus serves again after the
    reconnect. Without the grace this request waited its full 60 s."""
    server = NatsServer(store_dir=str(tmp_path / "nats")).start()
    srv = Bus(server.url, namespace, name="srv")
    cli = Bus(server.url, namespace, name="cli", lost_reply_grace_s=0.5)
    received, release = asyncio.Event(), asyncio.Event()

    async def answers_late(msg: Abort, ctx: MsgContext) -> Ack:
        received.set()
        await release.wait()  # the request is in flight: its server dies now
        return Ack(detail=msg.request_id)

    try:
        await srv.connect()
        await cli.connect()
        await srv.subscribe(srv.subjects.abort, Abort, answers_late, max_concurrency=4)
        await srv.flush()
        started = time.monotonic()
        pending = asyncio.create_task(
            cli.request(srv.subjects.abort, Abort(request_id="r"), Ack, timeout_s=60)
        )
        await asyncio.wait_for(received.wait(), 10)
        server.kill()
        server.start()
        with pytest.raises(ServiceUnavailableError, match="connection dropped"):
            await asyncio.wait_for(pending, 30)
        assert time.monotonic() - started < 30
        release.set()
        for bus in (srv, cli):
            await asyncio.wait_for(bus.is_connected.wait(), 15)
        await srv.flush()
        reply = await cli.request(srv.subjects.abort, Abort(request_id="after"), Ack, timeout_s=10)
        assert reply.detail == "after"  # a request of the new connection is not given up
    finally:
        release.set()
        await srv.close()
        await cli.close()
        server.stop()

"""The bus wrapper against a real nats-server: typed request/reply, malformed input, registry TTL."""

from __future__ import annotations

import asyncio

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
    await server_bus.close()
    await client.close()


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

"""The CXL-RPC calls over a real nats-server: same replies and statuses as the shared-memory rings."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.aio.msg import Msg

from shared.bus import Bus
from shared.cxl.nats_rpc import NatsRpcClient, NatsRpcServer
from shared.cxl.rpc import STATUS_BAD_REQUEST
from shared.errors import DeadlineExceededError, InvalidRequestError, ServiceUnavailableError
from shared.natsserver import NatsServer

ECHO, RAISE, CUSTOM = 1, 2, 3


def handler(client_id: int, op: int, payload: memoryview) -> tuple[int, bytes]:
    if op == RAISE:
        raise ValueError("boom")
    if op == CUSTOM:
        return 123, b"custom"
    return 0, struct.pack("<I", client_id) + bytes(payload)[::-1]


async def _bus(server: NatsServer, namespace: str, name: str) -> Bus:
    bus = Bus(server.url, namespace, name=name)
    await bus.connect()
    return bus


async def _until(
    call: Callable[[], Awaitable[Any]], wanted: type[Exception] | None, deadline_s: float
) -> Any:
    """`call` until it returns (wanted None) or raises `wanted`, within a deadline: another connection's
    subscribe or unsubscribe reaches this one's requests a moment after its flush on a loaded machine (seen
    once each way: no responders right after start, a timeout instead of no responders right after stop)."""
    deadline = asyncio.get_running_loop().time() + deadline_s
    while True:
        try:
            result = await call()
        except (ServiceUnavailableError, DeadlineExceededError) as exc:
            if wanted is not None and isinstance(exc, wanted):
                return exc
            if asyncio.get_running_loop().time() > deadline:
                raise
            continue
        if wanted is None:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"still answered after {deadline_s}s: {result!r}")


async def test_ping_pong_statuses_and_failures(nats_server: NatsServer, namespace: str) -> None:
    pool_bus = await _bus(nats_server, namespace, "pool")
    engine_bus = await _bus(nats_server, namespace, "engine")
    subject = pool_bus.subjects.cxl_rpc("pool-0")
    server = NatsRpcServer(pool_bus, subject, handler)
    await server.start()
    client = NatsRpcClient(engine_bus, subject, client_id=7)
    try:
        first = await _until(lambda: client.acall(ECHO, b"abc", 0.5), None, 10.0)
        assert first == (0, struct.pack("<I", 7) + b"cba")
        assert await client.acall(CUSTOM, b"", 2.0) == (123, b"custom")
        with pytest.raises(ServiceUnavailableError, match="ValueError: boom"):
            await client.acall(RAISE, b"", 2.0)
        with pytest.raises(InvalidRequestError, match="op must be"):
            await client.acall(0x10000, b"", 2.0)
        # a thread other than the loop's may call synchronously; the loop itself may not
        assert await asyncio.to_thread(client.call, ECHO, b"xy", 2.0) == (0, struct.pack("<I", 7) + b"yx")
        with pytest.raises(RuntimeError, match="use acall"):
            client.call(ECHO, b"", 2.0)
        raw = await engine_bus.nc.request(subject, b"\x01", timeout=2)  # a request without its header
        assert struct.unpack_from("<I", raw.data)[0] == STATUS_BAD_REQUEST
        assert await client.acall(ECHO, b"", 2.0) == (0, struct.pack("<I", 7))
        await server.stop()
        gone = await _until(lambda: client.acall(ECHO, b"", 0.5), ServiceUnavailableError, 10.0)
        assert "no CXL-RPC server" in gone.message
    finally:
        client.close()
        await pool_bus.close()
        await engine_bus.close()


async def test_a_server_that_does_not_answer_is_a_deadline(nats_server: NatsServer, namespace: str) -> None:
    bus = await _bus(nats_server, namespace, "quiet")
    subject = bus.subjects.cxl_rpc("quiet")

    async def swallow(msg: Msg) -> None:
        return None

    await bus.subscribe_raw(subject, swallow)
    await bus.flush()
    client = NatsRpcClient(bus, subject)
    try:
        with pytest.raises(DeadlineExceededError, match=r"within 0\.200s"):
            await client.acall(ECHO, b"x", 0.2)
    finally:
        await bus.close()

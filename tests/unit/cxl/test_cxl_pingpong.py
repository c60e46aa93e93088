"""CXL-RPC in one process (a server thread, clients beside it): replies, the transport's error statuses,
bad input refused, several calls in flight, deadlines, slots coming back, entries released."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from shared.cxl.rpc import RpcClient, RpcConfig, RpcServer
from shared.errors import DeadlineExceededError, InvalidRequestError, ServiceUnavailableError
from shared.shm import segment_path

ECHO, RAISE, TOO_BIG, BAD_STATUS, CUSTOM, BLOCK, ARRAY = range(1, 8)


class Handler:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.dead: list[int] = []
        self.is_dead = threading.Event()

    def __call__(self, client_id: int, op: int, payload: memoryview) -> tuple[int, bytes | memoryview]:
        replies: dict[int, Callable[[], tuple[int, bytes | memoryview]]] = {
            ECHO: lambda: (0, bytes(payload)[::-1]),
            TOO_BIG: lambda: (0, b"x" * 2048),
            BAD_STATUS: lambda: (5, b""),
            CUSTOM: lambda: (123, b"custom"),
            ARRAY: lambda: (0, np.arange(4, dtype=np.uint64).data),  # a memoryview of 8-byte items
        }
        if op == RAISE:
            raise ValueError("boom")
        if op == BLOCK:
            self.release.wait(10)
            return 0, b"late"
        return replies[op]()

    def on_dead(self, client_id: int) -> None:
        self.dead.append(client_id)
        self.is_dead.set()


@pytest.fixture
def served() -> Iterator[tuple[str, Handler]]:
    name = "kvpath-test-cxl-" + uuid.uuid4().hex[:10]
    handler = Handler()
    config = RpcConfig(num_clients=2, queue_depth=4, payload_bytes=1024)
    server = RpcServer(name, handler, config=config, on_client_dead=handler.on_dead)
    server.start()
    yield name, handler
    handler.release.set()
    server.close()
    assert not segment_path(name).exists()


def test_ping_pong_and_reply_shapes(served: tuple[str, Handler]) -> None:
    name, _ = served
    with RpcClient(name) as client:
        assert client.call(ECHO, b"hello", 5.0) == (0, b"olleh")
        assert client.call(ECHO, bytearray(b"ab"), 5.0) == (0, b"ba")
        assert client.call(ECHO, memoryview(b"xyz")[1:], 5.0) == (0, b"zy")
        assert client.call(ECHO, b"", 5.0) == (0, b"")
        full = bytes(range(256)) * 4
        assert client.call(ECHO, full, 5.0) == (0, full[::-1])
        assert client.call(CUSTOM, b"", 5.0) == (123, b"custom")
        assert client.call(ARRAY, b"", 5.0) == (0, np.arange(4, dtype=np.uint64).tobytes())
        assert client.payload_bytes == 1024 and client.queue_depth == 4 and client.server_epoch > 0


def test_the_transport_statuses_raise_and_the_server_keeps_serving(served: tuple[str, Handler]) -> None:
    name, _ = served
    with RpcClient(name) as client:
        with pytest.raises(ServiceUnavailableError, match="handler failed: ValueError: boom"):
            client.call(RAISE, b"", 5.0)
        with pytest.raises(ServiceUnavailableError, match="reply too large"):
            client.call(TOO_BIG, b"", 5.0)
        with pytest.raises(ServiceUnavailableError, match="reserved status"):
            client.call(BAD_STATUS, b"", 5.0)
        with pytest.raises(ServiceUnavailableError, match="KeyError"):  # an op the handler does not know
            client.call(999, b"", 5.0)
        with pytest.raises(InvalidRequestError, match="exceeds the slot"):
            client.call(ECHO, b"x" * 1025, 5.0)
        with pytest.raises(InvalidRequestError, match="op must be"):
            client.call(0x10000, b"", 5.0)
        assert client.call(ECHO, b"ok", 5.0) == (0, b"ko")


async def test_several_acalls_in_flight_each_get_their_own_reply(served: tuple[str, Handler]) -> None:
    name, _ = served
    with RpcClient(name) as client:
        payloads = [bytes([i]) * (i * 37 % 1000) + str(i).encode() for i in range(24)]  # > queue_depth
        replies = await asyncio.gather(*(client.acall(ECHO, p, 10.0) for p in payloads))
        assert replies == [(0, p[::-1]) for p in payloads]


def test_a_full_ring_waits_for_a_slot_within_the_deadline(served: tuple[str, Handler]) -> None:
    name, handler = served
    with RpcClient(name) as client:
        blocked = [threading.Thread(target=client.call, args=(BLOCK, b"", 10.0)) for _ in range(4)]
        for thread in blocked:
            thread.start()
        deadline = time.monotonic() + 5
        while client._att._free:  # all four slots taken
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(DeadlineExceededError, match="all 4 slots in flight"):
            client.call(ECHO, b"x", 0.1)
        handler.release.set()
        for thread in blocked:
            thread.join(10)
        assert client.call(ECHO, b"x", 5.0) == (0, b"x")


def test_a_late_reply_gives_its_slot_back(served: tuple[str, Handler]) -> None:
    name, handler = served
    with RpcClient(name) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            client.call(BLOCK, b"", 0.1)
        assert time.monotonic() - started < 2
        assert len(client._att._free) == 3  # the slot stays with the server until it answers
        handler.release.set()
        assert client.call(ECHO, b"ab", 5.0) == (0, b"ba")  # queued behind the late reply, so it landed
        slots = [client._att.try_acquire_slot() for _ in range(4)]
        assert None not in slots  # the fourth is the late one, taken back
        for slot in slots:
            client._att.release_slot(slot)  # type: ignore[arg-type]
        assert client.call(ECHO, b"cd", 5.0) == (0, b"dc")


async def test_a_cancelled_acall_leaves_no_slot_behind(served: tuple[str, Handler]) -> None:
    name, handler = served
    with RpcClient(name) as client:
        task = asyncio.ensure_future(client.acall(BLOCK, b"", 10.0))
        deadline = time.monotonic() + 5
        while len(client._att._free) == 4:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        handler.release.set()
        while len(client._att._free) < 4:  # the worker collects the late reply and frees the slot
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        assert await client.acall(ECHO, b"12", 5.0) == (0, b"21")


def test_closed_clients_are_released_and_entries_run_out_clearly(served: tuple[str, Handler]) -> None:
    name, handler = served
    first, second = RpcClient(name), RpcClient(name)
    assert {first.client_id, second.client_id} == {0, 1}
    with pytest.raises(ServiceUnavailableError, match="all 2 client entries"):
        RpcClient(name)
    gone = first.client_id
    first.close()
    assert handler.is_dead.wait(5) and handler.dead == [gone]
    with RpcClient(name) as third:
        assert third.client_id == gone
        assert third.call(ECHO, b"again", 5.0) == (0, b"niaga")
    second.close()


def test_no_server_is_a_fast_clear_error() -> None:
    started = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match="does not exist"):
        RpcClient("kvpath-test-cxl-nobody-" + uuid.uuid4().hex[:8])
    assert time.monotonic() - started < 1

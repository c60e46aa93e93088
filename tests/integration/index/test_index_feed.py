"""The index's KV-event feed against a real nats-server: an event is delivered as it arrives, whatever
phase of the feed's fetch cycle it lands in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from services.index.feed import EventFeed, stream_seq_of
from shared.bus import Bus
from shared.kvclient import KvEventPublisher
from shared.natsserver import NatsServer

WINDOW_S = 0.4  # one fetch's wait; the old feed could hold an event for up to about this long
ROUNDS = 6


@pytest.fixture
async def bus(nats_server: NatsServer, namespace: str) -> AsyncIterator[Bus]:
    b = Bus(nats_server.url, namespace, name="test-feed")
    await b.connect()
    yield b
    await b.close()


async def test_events_after_an_idle_fetch_window_are_delivered_as_they_arrive(bus: Bus) -> None:
    """Each round lets a fetch window end empty (the moment nats-py's batch fetch could take the expired
    request's late 408 for its own answer and leave a lingering pull for 512 messages behind, which then
    held the next event until it expired: 120-300 ms at a 0.5 s window), then publishes two events one
    after the other. Every event reaches the feed's caller well within the window."""
    publisher = KvEventPublisher(bus, "feed")
    await publisher.start()
    feed = EventFeed(bus, bus.subjects.kv_events_stream, fetch_batch=512, fetch_wait_s=WINDOW_S)
    await feed.open(1)
    loop = asyncio.get_running_loop()
    arrived: dict[int, float] = {}
    changed = asyncio.Condition()
    idle_windows = 0

    async def tail() -> None:
        nonlocal idle_windows
        while True:
            msgs = await feed.fetch()
            async with changed:
                idle_windows += not msgs
                arrived.update((stream_seq_of(m), loop.time()) for m in msgs)
                changed.notify_all()

    async def until(predicate: Callable[[], bool]) -> None:
        async with changed:
            await asyncio.wait_for(changed.wait_for(predicate), timeout=5.0)

    task = asyncio.create_task(tail())
    late: list[float] = []
    try:
        for r in range(ROUNDS):
            windows = idle_windows
            await until(lambda w=windows: idle_windows > w)  # a fetch window ended with nothing
            for i in range(2):
                sent = loop.time()
                seq = await publisher.stored("store", [1 + 10 * r + i])
                await until(lambda s=seq: s in arrived)
                late.append(arrived[seq] - sent)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await feed.close()
    assert max(late) < WINDOW_S / 2, [round(x * 1e3) for x in late]

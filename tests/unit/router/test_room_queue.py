"""The line of requests waiting for a decode engine's room: first come first served, one ask per report."""

from __future__ import annotations

import asyncio
import time

from services.router.room_queue import RoomQueue


async def _queued(room: RoomQueue, n: int) -> None:
    """Until `n` requests stand in line (each `wait` queues before its first await)."""
    for _ in range(100):
        if len(room) == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(room)} in line, expected {n}")


async def test_a_report_lets_only_the_head_ask_and_a_taken_head_lets_the_next() -> None:
    room, deadline = RoomQueue(), time.monotonic() + 10
    a = asyncio.create_task(room.wait("de", deadline))
    b = asyncio.create_task(room.wait("de", deadline))
    c = asyncio.create_task(room.wait("other", deadline))
    await _queued(room, 3)
    room.reported("de")
    await asyncio.wait_for(a, 5)
    assert not b.done() and not c.done()  # one ask per report, and only the reporting engine's line
    room.taken("de")  # a got in: b asks at once
    await asyncio.wait_for(b, 5)
    assert not c.done() and len(room) == 1
    room.reported("other")
    await asyncio.wait_for(c, 5)
    assert len(room) == 0


async def test_a_head_refused_again_stays_in_front() -> None:
    room, deadline = RoomQueue(), time.monotonic() + 10
    a = asyncio.create_task(room.wait("de", deadline))
    await _queued(room, 1)
    b = asyncio.create_task(room.wait("de", deadline))
    await _queued(room, 2)
    room.reported("de")
    await asyncio.wait_for(a, 5)
    again = asyncio.create_task(room.wait("de", deadline, again=True))  # a was refused again
    await _queued(room, 2)
    room.reported("de")
    await asyncio.wait_for(again, 5)
    assert not b.done()
    b.cancel()


async def test_the_deadline_takes_a_request_out_of_the_line() -> None:
    room = RoomQueue()
    await asyncio.wait_for(room.wait("de", time.monotonic() + 0.05), 5)  # returns at its deadline
    assert len(room) == 0
    later = asyncio.create_task(room.wait("de", time.monotonic() + 10))
    await _queued(room, 1)
    room.reported("de")  # the report goes to the one still waiting, not to the one that left
    await asyncio.wait_for(later, 5)

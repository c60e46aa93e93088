"""The PE's staging line (`prefill_connector.StagingLine`): room in the staging buffer first come first
served, with no overtaking, and a request that gives up leaves the line without keeping room."""

from __future__ import annotations

import asyncio

import pytest

from services.engine.prefill_connector import StagingLine
from shared.blocks import ExtentAllocator

PAGE = 4096


def line(pages: int) -> StagingLine:
    return StagingLine(ExtentAllocator(pages * PAGE, alignment=PAGE))


async def test_requests_get_room_in_arrival_order_and_a_small_one_does_not_overtake() -> None:
    s = line(4)
    first = s.now(3 * PAGE)
    assert first is not None and s.now(PAGE) is not None  # room left: no wait
    assert s.now(PAGE) is None  # full
    big = asyncio.create_task(s.wait("big", 3 * PAGE, 5.0))
    small = asyncio.create_task(s.wait("small", PAGE, 5.0))
    await asyncio.sleep(0)
    assert s.now(PAGE) is None  # others wait: no extent at once, even with room
    s.free(first)  # three pages free: the head (big) gets them; small, behind it, waits on
    assert await asyncio.wait_for(big, 1.0) == first
    assert not small.done()
    s.free(first)
    assert await asyncio.wait_for(small, 1.0) is not None


async def test_a_request_that_gives_up_leaves_the_line_and_keeps_nothing() -> None:
    s = line(2)
    held = s.now(2 * PAGE)
    assert held is not None
    with pytest.raises(TimeoutError):
        await s.wait("late", PAGE, 0.01)
    cancelled = asyncio.create_task(s.wait("cancelled", PAGE, 5.0))
    behind = asyncio.create_task(s.wait("behind", 2 * PAGE, 5.0))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    s.free(held)  # the head left: the one behind it gets the whole buffer
    assert await asyncio.wait_for(behind, 1.0) == held
    assert s.extents.free_bytes == 0


def test_a_prompt_larger_than_the_buffer_is_known_at_once() -> None:
    s = line(2)
    assert s.fits(2 * PAGE) and s.fits(2 * PAGE - 100) and not s.fits(2 * PAGE + 1)
    ragged = StagingLine(ExtentAllocator(2 * PAGE + 100, alignment=PAGE))  # 2 whole pages usable
    assert ragged.fits(2 * PAGE) and not ragged.fits(2 * PAGE + 50)

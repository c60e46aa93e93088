"""shared/background.Background: held until done, a grace period on close, then cancelled within a bound."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from shared.background import Background


async def test_close_lets_work_finish_within_the_grace_and_cancels_the_rest() -> None:
    background = Background()
    finished: list[str] = []

    async def work(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        finished.append(name)

    quick = background.keep(work("quick", 0.01))
    stuck = background.keep(work("stuck", 60))
    assert len(background) == 2
    assert not await background.settled(0.001)
    await background.close(grace_s=0.5)
    assert finished == ["quick"] and quick.done() and stuck.cancelled()
    assert len(background) == 0  # done tasks are dropped


async def test_a_failure_is_logged_once_not_left_never_retrieved(caplog: pytest.LogCaptureFixture) -> None:
    background = Background()
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    async def fail() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.WARNING, logger="shared.background"):
        task = background.keep(fail())
        await asyncio.wait([task])
        await asyncio.sleep(0)  # the done callback
    assert len(background) == 0
    assert [r.getMessage() for r in caplog.records] == ["background work failed: RuntimeError('boom')"]
    del task
    gc.collect()
    assert not reported  # nothing reported again at garbage collection


async def test_close_without_grace_cancels_at_once() -> None:
    background = Background()
    task = background.keep(asyncio.sleep(60))
    await background.close()
    assert task.cancelled()

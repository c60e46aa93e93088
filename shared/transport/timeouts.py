"""Deadlines for every wait of the data plane, reported as DeadlineExceededError.

`deadline`: an asyncio timeout around a body (slow paths: connect, lookup, a send the kernel did not take
at once). Hot paths (a write awaiting its ack, a wait for a notice) use cheaper means: a `Deadline`
value, and a timer that fails the awaited future (`fail_at`, or one `DeadlineWatch` per channel).
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType
from typing import Any

from shared.errors import DeadlineExceededError


class deadline:
    """Run the body within `timeout_s`; past it, raise DeadlineExceededError naming `what`.

    A class rather than an asynccontextmanager (cheaper).
    """

    __slots__ = ("_timeout", "timeout_s", "what")

    def __init__(self, timeout_s: float, what: str) -> None:
        if not timeout_s > 0:
            raise DeadlineExceededError(
                f"{what}: timeout_s must be > 0, got {timeout_s!r}", param="timeout_s"
            )
        self.timeout_s = timeout_s
        self.what = what
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        self._timeout = asyncio.timeout(self.timeout_s)
        await self._timeout.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._timeout is not None
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            raise DeadlineExceededError(f"{self.what}: not done within {self.timeout_s:g} s") from None


class Deadline:
    """An op's deadline: an instant on the event loop's clock and what to say when it passes. It arms no
    timer itself (`DeadlineWatch` or `fail_at` do, and only where the op must wait)."""

    __slots__ = ("at", "timeout_s", "what")

    def __init__(self, timeout_s: float, what: str, now: float) -> None:
        if not timeout_s > 0:
            raise DeadlineExceededError(
                f"{what}: timeout_s must be > 0, got {timeout_s!r}", param="timeout_s"
            )
        self.at = now + timeout_s
        self.timeout_s = timeout_s
        self.what = what

    def error(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"{self.what}: not done within {self.timeout_s:g} s")

    def remaining_s(self) -> float:
        """Seconds left (> 0); DeadlineExceededError when none are."""
        left = self.at - asyncio.get_running_loop().time()
        if left <= 0:
            raise self.error()
        return left


def _expire(future: asyncio.Future[Any], when: Deadline) -> None:
    if not future.done():
        future.set_exception(when.error())


def fail_at(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], when: Deadline) -> asyncio.Handle:
    """Fail `future` with DeadlineExceededError at `when` unless it is done by then; cancel the handle
    once it is. A timer on the future, not a cancellation of the task: about a third of `deadline`'s cost."""
    return loop.call_at(when.at, _expire, future, when)


class DeadlineWatch:
    """Deadlines of many ops with one timer: a watched op whose deadline passes has its future (looked up
    by key in `futures`, a dict its owner keeps current) failed with DeadlineExceededError.

    Per op this is a dict insert and delete; the timer is re-armed only for a deadline earlier than the
    armed one, so back-to-back ops with the same timeout share it (it fires once per timeout, finds
    nothing due, and re-arms for the earliest deadline still watched).
    """

    __slots__ = ("_futures", "_loop", "_timer", "_timer_at", "_watched")

    def __init__(self, loop: asyncio.AbstractEventLoop, futures: dict[int, asyncio.Future[Any]]) -> None:
        self._loop = loop
        self._futures = futures
        self._watched: dict[int, Deadline] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def watch(self, key: int, when: Deadline) -> None:
        self._watched[key] = when
        if when.at < self._timer_at:
            self._arm(when.at)

    def forget(self, key: int) -> None:
        self._watched.pop(key, None)

    def stop(self) -> None:
        self._watched.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(at, self._fire), at

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = self._loop.time()
        for key, when in list(self._watched.items()):
            if when.at <= now:
                del self._watched[key]
                future = self._futures.get(key)
                if future is not None and not future.done():
                    future.set_exception(when.error())
        if self._watched:
            self._arm(min(when.at for when in self._watched.values()))

"""Requests waiting for a decode engine to have room again (its DE buffer or queue was full), first come first
served: each load report of the engine lets the head of its line ask again; a head the engine took lets the
next one ask at once, and a head refused again stays at the head. So a full engine sees about one refused
ask per report, however many wait (before, every waiter asked on every report: 4,585 refusals for 100
requests), and the engine's room goes to the requests in the order they came."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque


class RoomQueue:
    def __init__(self) -> None:
        self._lines: dict[str, deque[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    async def wait(self, engine_id: str, deadline: float, *, again: bool = False) -> None:
        """Until it is this request's turn to ask `engine_id` (one of its load reports came, or the request
        ahead got in), at most until the monotonic `deadline`. `again`: refused as the head: stay in front."""
        line = self._lines.setdefault(engine_id, deque())
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if again:
            line.appendleft(turn)
        else:
            line.append(turn)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(turn), max(0.0, deadline - time.monotonic()))
        finally:
            if not turn.done():  # the deadline or a cancel: it leaves the line
                line.remove(turn)
            if not line:
                self._lines.pop(engine_id, None)

    def reported(self, engine_id: str) -> None:
        """`engine_id` reported: its room may be back, the head of its line asks."""
        self._next(engine_id)

    def taken(self, engine_id: str) -> None:
        """`engine_id` took a request that waited: the next in line asks at once."""
        self._next(engine_id)

    def _next(self, engine_id: str) -> None:
        line = self._lines.get(engine_id)
        if line:
            line.popleft().set_result(None)

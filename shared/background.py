"""Work an object starts on the side and owns until it closes (a commit, an unpin, an announcement, a drain).

asyncio keeps only weak references to tasks, so whoever starts one must hold it; and whoever holds it must
end it when it closes, within a bounded time. `Background` does both: `keep` starts and holds, `close` gives
the work a grace period to finish, cancels what is left and waits (bounded) for the cancellations.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 1.0  # how long close() waits for cancelled work to unwind (it never hangs on a stuck task)


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def keep(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run `work` (a coroutine or future) in the background, held until it ends."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._settle)
        return task

    def _settle(self, task: asyncio.Future[Any]) -> None:
        """A task ended: let it go; a failure nobody handled is logged here, once (not at garbage
        collection as "never retrieved")."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("background work failed: %r", exc, exc_info=exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def settled(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until the work started so far has ended; whether it has."""
        tasks = list(self._tasks)
        if tasks:
            _, left = await asyncio.wait(tasks, timeout=timeout_s)
            return not left
        return True

    async def close(self, grace_s: float = 0.0) -> None:
        """Let the work run up to `grace_s` seconds more, then cancel the rest and wait (bounded) for it."""
        tasks = list(self._tasks)
        if not tasks:
            return
        if grace_s > 0:
            _, left = await asyncio.wait(tasks, timeout=grace_s)
            tasks = list(left)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)

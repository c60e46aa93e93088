"""Work for the model thread that a forward blocked on a remote reply runs while it waits.

The model thread runs one call at a time. A forward with routed requests (move the query) blocks it until
the holders' partials come back, and a holder's partial attention is itself a call on its model thread. Two
engines that each hold a chunk the other's requests route to would then each wait for the other's forward:
a circular wait that only the exchange's deadline ends (each request falls back, every step). So a holder's
call is posted here as well as queued on the thread: whichever comes first runs it, the thread once it is
free, or a forward of that thread blocked in `wait` (between layers, where nothing of the forward is in use
that the call touches: it reads only pinned chunk blocks and makes its own tensors).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class _Job:
    __slots__ = ("claimed", "fn", "future")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.claimed = False

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # the caller gets it, as from the executor
            self.future.set_exception(exc)


class SideWork:
    """Calls posted for the model thread that a blocked forward may run (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self.num_run_waiting = 0  # calls a blocked forward ran

    def post(self, fn: Callable[[], Any]) -> _Job:
        """Post a call; run it with `run` on the thread's own queue too (its future has the result)."""
        job = _Job(fn)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()
        return job

    def run(self, job: _Job) -> None:
        """The model thread's turn for a posted call: run it, unless a waiting forward already did."""
        if self._claim(job):
            job.run()

    def wait(self, future: concurrent.futures.Future[Any], timeout_s: float) -> Any:
        """`future.result(timeout_s)`, running posted calls while it is not done (TimeoutError past it)."""
        deadline = time.monotonic() + timeout_s
        future.add_done_callback(self._wake)
        while True:
            with self._cond:
                while not future.done() and not self._jobs:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"no reply within {timeout_s:.3g} s")
                    self._cond.wait(remaining)
                job = None if future.done() else self._jobs[0]
            if job is None:
                return future.result(0)
            if self._claim(job):
                self.num_run_waiting += 1
                job.run()

    def _claim(self, job: _Job) -> bool:
        with self._cond:
            if job.claimed:
                return False
            job.claimed = True
            self._jobs.remove(job)
            return True

    def _wake(self, _: object) -> None:
        with self._cond:
            self._cond.notify_all()

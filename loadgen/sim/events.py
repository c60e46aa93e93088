"""The discrete-event core: a heap of (time, priority, sequence) -> callback, on a simulated clock in seconds.

Events at the same time run by priority (lower first), then in the order they were scheduled, so a run is a
pure function of its inputs. Callbacks schedule further events; nothing here knows what they do.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from shared.errors import KvpathError

PRIORITY_NORMAL = 0
PRIORITY_LATE = 1  # after every normal event of the same instant (scheduling rounds, samplers)


class EventLoop:
    __slots__ = ("_heap", "_seq", "now", "num_events", "stopped")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.now = 0.0
        self.num_events = 0
        self.stopped = False

    def at(
        self, time_s: float, callback: Callable[..., None], *args: Any, priority: int = PRIORITY_NORMAL
    ) -> None:
        """Run `callback(*args)` at `time_s` (not before now)."""
        if not time_s >= self.now or math.isnan(time_s):
            raise KvpathError(f"event scheduled in the past: {time_s} < now {self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (time_s, priority, self._seq, callback, args))

    def after(
        self, delay_s: float, callback: Callable[..., None], *args: Any, priority: int = PRIORITY_NORMAL
    ) -> None:
        self.at(self.now + max(0.0, delay_s), callback, *args, priority=priority)

    def stop(self) -> None:
        self.stopped = True

    def run(self, until_s: float = math.inf) -> None:
        """Process events in order until none is left, `stop()` is called, or the next is after `until_s`."""
        heap = self._heap
        while heap and not self.stopped:
            if heap[0][0] > until_s:
                self.now = until_s
                return
            time_s, _, _, callback, args = heapq.heappop(heap)
            self.now = time_s
            self.num_events += 1
            callback(*args)

    @property
    def is_idle(self) -> bool:
        return not self._heap

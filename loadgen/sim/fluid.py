"""A fluid link: processor sharing of a bandwidth among the flows on it (a NIC direction, a copy engine).

Each of the n active flows moves at capacity / n bytes/s. The link keeps a virtual clock, the bytes every
active flow has received so far, so a flow ends when the clock reaches its start value plus its size: one
pending timer per link, no per-flow updates. At most `max_active` flows share the link at once (a storage
service's I/O depth); later ones wait in FIFO order. An infinite capacity ends flows at once (the Oracle).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from loadgen.sim.events import EventLoop
from shared.errors import ConfigError

Done = Callable[[], None]


class FluidLink:
    __slots__ = (
        "_active",
        "_bytes_done",
        "_seq",
        "_updated_s",
        "_version",
        "_virtual",
        "_waiting",
        "capacity_bytes_per_s",
        "loop",
        "max_active",
        "name",
    )

    def __init__(
        self, loop: EventLoop, capacity_bytes_per_s: float, *, max_active: int = 0, name: str = ""
    ) -> None:
        if not capacity_bytes_per_s > 0:
            raise ConfigError(f"link {name!r}: capacity {capacity_bytes_per_s} bytes/s must be > 0")
        self.loop = loop
        self.capacity_bytes_per_s = capacity_bytes_per_s
        self.max_active = max_active
        self.name = name
        self._virtual = 0.0
        self._updated_s = 0.0
        self._bytes_done = 0.0
        self._active: list[tuple[float, int, Done]] = []
        self._waiting: deque[tuple[float, Done]] = deque()
        self._seq = 0
        self._version = 0

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def bytes_moved(self, at_s: float | None = None) -> float:
        """Bytes the link has moved by `at_s` (default now; not before its last change)."""
        at = self.loop.now if at_s is None else at_s
        if not self._active:
            return self._bytes_done
        return self._bytes_done + (at - self._updated_s) * self.capacity_bytes_per_s

    def start(self, size_bytes: float, on_done: Done) -> None:
        """Move `size_bytes`; `on_done()` runs when the last byte has arrived."""
        if size_bytes <= 0 or math.isinf(self.capacity_bytes_per_s):
            self._bytes_done += max(0.0, size_bytes)
            self.loop.at(self.loop.now, on_done)
            return
        self._advance()
        if self.max_active and len(self._active) >= self.max_active:
            self._waiting.append((size_bytes, on_done))
            return
        self._activate(size_bytes, on_done)
        self._arm()

    def _activate(self, size_bytes: float, on_done: Done) -> None:
        self._seq += 1
        heapq.heappush(self._active, (self._virtual + size_bytes, self._seq, on_done))

    def _advance(self) -> None:
        now = self.loop.now
        if self._active:
            elapsed = now - self._updated_s
            self._virtual += elapsed * self.capacity_bytes_per_s / len(self._active)
            self._bytes_done += elapsed * self.capacity_bytes_per_s
        self._updated_s = now

    def _arm(self) -> None:
        self._version += 1
        if not self._active:
            self._virtual = 0.0  # idle: restart the clock (keeps it small, so precise)
            return
        remaining = self._active[0][0] - self._virtual
        delay = max(0.0, remaining) * len(self._active) / self.capacity_bytes_per_s
        self.loop.at(self.loop.now + delay, self._on_timer, self._version)

    def _on_timer(self, version: int) -> None:
        if version != self._version:
            return  # superseded by a later change
        self._advance()
        finished: list[Done] = []
        # what is left below rounding (of the byte count, or of the clock: a delay too small to move `now`)
        clock_bytes = 4 * math.ulp(max(1.0, self.loop.now)) * self.capacity_bytes_per_s / len(self._active)
        while self._active:
            finish = self._active[0][0]
            if finish - self._virtual > max(1e-9 * max(1.0, finish), clock_bytes):
                break
            finished.append(heapq.heappop(self._active)[2])
        while self._waiting and (not self.max_active or len(self._active) < self.max_active):
            self._activate(*self._waiting.popleft())
        self._arm()
        for on_done in finished:
            on_done()

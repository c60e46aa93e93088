"""AMPD's windowed statistics (brief §2.2, §8 #3-4): the mean TTFT of each prefill engine and the mean ITL of
each decode engine over the last `window_s` seconds, which Algorithm 1 compares with the SLOs.

Pure bookkeeping with an explicit clock: the caller passes `now` (the router its monotonic clock, the
simulator its simulated one). A sample is (time, value, weight): an ITL gap spanning n tokens is one sample of
weight n, so the mean is per token. An empty window reads 0 (no recent evidence of congestion: slack).
Adding and reading are O(1) amortized (a deque with running sums), so the router can feed every token batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

WINDOW_S = 10.0  # paper §3: "the average over the past 10 seconds"


class WindowedMean:
    __slots__ = ("_samples", "_sum", "_weight", "window_s")

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s={window_s}: must be > 0")
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float]] = deque()
        self._sum = 0.0
        self._weight = 0.0

    def add(self, now: float, value: float, weight: float = 1.0) -> None:
        if weight <= 0:
            return
        self._samples.append((now, value * weight, weight))
        self._sum += value * weight
        self._weight += weight

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        samples = self._samples
        while samples and samples[0][0] < horizon:
            _, weighted, weight = samples.popleft()
            self._sum -= weighted
            self._weight -= weight
        if not samples:  # no drift from repeated float subtraction
            self._sum = self._weight = 0.0

    def mean(self, now: float) -> float:
        """The weighted mean of the samples in (now - window_s, now]; 0 when there are none."""
        self._expire(now)
        return self._sum / self._weight if self._weight > 0 else 0.0

    def count(self, now: float) -> int:
        self._expire(now)
        return len(self._samples)


class EngineWindows:
    """One WindowedMean per engine id, created on first use; `forget` drops engines that left."""

    __slots__ = ("_by_engine", "window_s")

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._by_engine: dict[str, WindowedMean] = {}

    def add(self, engine_id: str, now: float, value: float, weight: float = 1.0) -> None:
        window = self._by_engine.get(engine_id)
        if window is None:
            window = self._by_engine[engine_id] = WindowedMean(self.window_s)
        window.add(now, value, weight)

    def mean(self, engine_id: str, now: float) -> float:
        window = self._by_engine.get(engine_id)
        return window.mean(now) if window is not None else 0.0

    def forget(self, live_ids: Iterable[str]) -> None:
        keep = set(live_ids)
        for engine_id in [e for e in self._by_engine if e not in keep]:
            del self._by_engine[engine_id]

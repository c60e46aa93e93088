"""Storage load balance (DualPath 7.11): max/avg of per-node storage traffic per time window.

Pure code over sampled cumulative byte counters; `kvpath bench dualpath` samples the storage services'
metrics, the simulator its storage NIC links.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.errors import ConfigError, KvpathError


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise KvpathError(f"inconsistent storage samples: {what}")


@dataclass(frozen=True, slots=True)
class BalanceReport:
    """Per-window max/avg of per-node storage bytes; 1.0 is perfect balance.

    `ratios` covers the counted windows in time order; `num_skipped_windows` windows carried no traffic (or
    less than `min_load_fraction` of the busiest window) and are left out, as the paper leaves out its
    underloaded tail. `mean_ratio` / `max_ratio` are None when no window counted.
    """

    window_s: float
    ratios: tuple[float, ...]
    num_skipped_windows: int

    @property
    def mean_ratio(self) -> float | None:
        return statistics.fmean(self.ratios) if self.ratios else None

    @property
    def max_ratio(self) -> float | None:
        return max(self.ratios) if self.ratios else None


def _counter_at(times: list[float], values: list[float], t: float) -> float:
    """A node's cumulative bytes at `t`: linear between samples, flat before the first and after the last."""
    i = bisect.bisect_right(times, t)
    if i == 0:
        return values[0]
    if i == len(times):
        return values[-1]
    t0, t1 = times[i - 1], times[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (t - t0) / (t1 - t0)


def _counter_series(
    samples: Sequence[tuple[float, int, float]],
) -> dict[int, tuple[list[float], list[float]]]:
    series: dict[int, tuple[list[float], list[float]]] = {}
    for t, node, total in sorted(samples, key=lambda s: (s[1], s[0])):
        times, values = series.setdefault(node, ([], []))
        if times and t == times[-1]:
            _require(total == values[-1], f"node {node} has two byte counts at t={t}")
            continue
        _require(not values or total >= values[-1], f"node {node} byte counter went down at t={t}")
        times.append(t)
        values.append(total)
    return series


def _bytes_per_window(
    series: dict[int, tuple[list[float], list[float]]], edges: list[float]
) -> list[list[float]]:
    """Bytes each node moved between consecutive `edges`: one list per window, one entry per sampled node."""
    per_window: list[list[float]] = [[] for _ in range(len(edges) - 1)]
    for times, values in series.values():
        at = [_counter_at(times, values, t) for t in edges]
        for k, window in enumerate(per_window):
            window.append(at[k + 1] - at[k])
    return per_window


def storage_balance(
    samples: Sequence[tuple[float, int, float]],
    window_s: float,
    *,
    nodes: Iterable[int] = (),
    min_load_fraction: float = 0.0,
) -> BalanceReport:
    """Max/avg storage traffic across nodes per time window (brief 7.11), from sampled cumulative counters.

    `samples` are (t_s, node, cumulative_bytes); counters must not decrease. Windows tile [first sample, last
    sample] from the first sample on; the last one may be shorter (the ratio does not depend on the window's
    length). A node's bytes in a window are its counter's increase, interpolated linearly between samples.
    Nodes in `nodes` that never appear in `samples` count as zero traffic (an idle SNIC is imbalance).
    """
    if not (math.isfinite(window_s) and window_s > 0):
        raise ConfigError(f"window_s={window_s}: must be > 0", param="window_s")
    if not 0.0 <= min_load_fraction <= 1.0:
        raise ConfigError(
            f"min_load_fraction={min_load_fraction}: must be in [0, 1]", param="min_load_fraction"
        )
    series = _counter_series(samples)
    if not series:
        return BalanceReport(window_s=window_s, ratios=(), num_skipped_windows=0)
    num_nodes = len(set(series) | set(nodes))
    t_first = min(times[0] for times, _ in series.values())
    t_last = max(times[-1] for times, _ in series.values())
    num_windows = max(1, math.ceil((t_last - t_first) / window_s))
    edges = [min(t_first + k * window_s, t_last) for k in range(num_windows + 1)]
    per_window = _bytes_per_window(series, edges)
    totals = [sum(w) for w in per_window]
    floor_bytes = min_load_fraction * max(totals)
    ratios = tuple(
        max(w) / (total / num_nodes)
        for w, total in zip(per_window, totals, strict=True)
        if total > 0 and total >= floor_bytes
    )
    return BalanceReport(window_s=window_s, ratios=ratios, num_skipped_windows=num_windows - len(ratios))

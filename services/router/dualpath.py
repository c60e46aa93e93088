"""DualPath scheduling inputs, outputs and thresholds (brief section 5), plus the storage load-balance metric.

Pure code: no I/O, no asyncio, no torch, no bus. The live router builds a `ClusterSnapshot` from load reports,
calls a policy in `services/router/placement.py` and acts on the returned `Placement`s; the simulator in
`loadgen/` calls the same functions on a simulated clock. Intra-engine PE batching lives in
`services/engine/batching.py`.

Units: every load is in tokens (the paper balances on token counts because GPU, disk and network load all
track them). `len_r` is the full prompt length (hit + miss tokens); a node's read queue is the hit tokens
waiting to be read from its storage.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from shared.errors import ConfigError, KvpathError

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"

ALPHA_S = 3.0  # paper A.4: alpha = tokens one node can read in 3 s
BETA_S = 5.0  # paper A.4: beta = tokens one GPU can prefill in 5 s
Z_FACTOR = 1.05  # paper 6.1: DE high-token threshold multiplier
# [INF] prefill rate assumed before any PE has reported one: a conservative CPU-scale guess (tiny models on
# this machine prefill a few thousand tokens/s); measured rates replace it on the first report.
FALLBACK_PREFILL_TOKENS_PER_S = 2000.0


class ReadSide(StrEnum):
    """Where a request's hit KV is read from storage: the PE's node (PE path) or the DE's node (DE path)."""

    PE = "pe"
    DE = "de"


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise KvpathError(f"inconsistent scheduling snapshot: {what}")


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine as its last load report (plus work sent since) describes it.

    `num_unfinished` is the paper's seq_e, `unfinished_tokens` its tok_e. `free_kv_tokens` is the free HBM of
    a DE in tokens (ignored for PEs: layerwise prefill holds one layer at a time). Engines of one node form
    one group; a group may span nodes (one EP/DP instance).
    """

    engine_id: str
    role: str
    node: int
    group: str
    num_unfinished: int
    unfinished_tokens: int
    free_kv_tokens: int = 0
    is_draining: bool = False

    def __post_init__(self) -> None:
        _require(self.role in (ROLE_PREFILL, ROLE_DECODE), f"engine {self.engine_id} role {self.role!r}")
        _require(
            min(self.num_unfinished, self.unfinished_tokens, self.free_kv_tokens) >= 0,
            f"engine {self.engine_id} has a negative load field",
        )


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One node's storage side: pending reads (tokens) and whether its storage service answers."""

    node: int
    read_queue_tokens: int
    is_storage_alive: bool = True

    def __post_init__(self) -> None:
        _require(self.read_queue_tokens >= 0, f"node {self.node} read_queue_tokens {self.read_queue_tokens}")


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A queued request: `prompt_tokens` = len_r, `hit_tokens` stored prefix, `hbm_need_tokens` = prompt +
    expected generation (the DE HBM it will occupy; brief 5.3 [INF])."""

    request_id: str
    prompt_tokens: int
    hit_tokens: int
    hbm_need_tokens: int

    def __post_init__(self) -> None:
        _require(
            0 <= self.hit_tokens <= self.prompt_tokens <= self.hbm_need_tokens,
            f"request {self.request_id}: need 0 <= hit_tokens={self.hit_tokens} <= "
            f"prompt_tokens={self.prompt_tokens} <= hbm_need_tokens={self.hbm_need_tokens}",
        )


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Everything a placement decision reads: engines, nodes and the global FIFO queue (head first)."""

    engines: tuple[EngineSnapshot, ...]
    nodes: tuple[NodeSnapshot, ...]
    queue: tuple[PendingRequest, ...]

    def __post_init__(self) -> None:
        engine_ids = [e.engine_id for e in self.engines]
        _require(len(set(engine_ids)) == len(engine_ids), "duplicate engine ids")
        node_ids = {n.node for n in self.nodes}
        _require(len(node_ids) == len(self.nodes), "duplicate node ids")
        missing = sorted({e.node for e in self.engines} - node_ids)
        _require(not missing, f"engines on nodes without a node snapshot: {missing}")
        request_ids = [r.request_id for r in self.queue]
        _require(len(set(request_ids)) == len(request_ids), "duplicate request ids in the queue")

    def with_role(self, role: str) -> tuple[EngineSnapshot, ...]:
        return tuple(e for e in self.engines if e.role == role)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """alpha: a node read queue at or below it is "short"; beta: a PE above it gets nothing (tokens both)."""

    alpha_tokens: float
    beta_tokens: float
    z_factor: float = Z_FACTOR

    def __post_init__(self) -> None:
        if not (self.alpha_tokens >= 0 and self.beta_tokens >= 0):
            raise ConfigError(
                f"alpha_tokens={self.alpha_tokens}, beta_tokens={self.beta_tokens}: must be >= 0"
            )
        if not (math.isfinite(self.z_factor) and self.z_factor > 0):
            raise ConfigError(f"invalid z_factor={self.z_factor!r}: must be > 0", param="z_factor")


def _median_rate(rates: Iterable[float]) -> float | None:
    measured = [r for r in rates if math.isfinite(r) and r > 0]
    return statistics.median(measured) if measured else None


def thresholds_from_rates(
    read_tokens_per_s: Iterable[float] = (),
    prefill_tokens_per_s: Iterable[float] = (),
    *,
    alpha_s: float = ALPHA_S,
    beta_s: float = BETA_S,
    z_factor: float = Z_FACTOR,
    fallback_read_tokens_per_s: float | None = None,
    fallback_prefill_tokens_per_s: float = FALLBACK_PREFILL_TOKENS_PER_S,
) -> Thresholds:
    """Turn alpha_s / beta_s into tokens through measured rates (paper: profiled in advance).

    `read_tokens_per_s` holds each node's measured storage read rate, `prefill_tokens_per_s` each PE's
    measured prefill rate; zero, negative or non-finite entries mean "not measured yet" and are ignored. The
    median of the measured rates is used (the paper's nodes have equal SNICs and GPUs; the median ignores one
    node that just started). Fallbacks when nothing is measured: reads use `fallback_read_tokens_per_s` (the
    router can pass storage bandwidth / KV bytes per token); when that is None too, alpha is infinite, so
    every node counts as "short" and PE choice is plain fewest-tokens (the read side still balances queues).
    Prefill falls back to `fallback_prefill_tokens_per_s`; beta must stay finite or the router would hand its
    whole queue out at once.
    """
    if not (alpha_s > 0 and beta_s > 0):
        raise ConfigError(f"alpha_s={alpha_s}, beta_s={beta_s}: must be > 0", param="alpha_s")
    if not fallback_prefill_tokens_per_s > 0:
        raise ConfigError(
            f"fallback_prefill_tokens_per_s={fallback_prefill_tokens_per_s}: must be > 0",
            param="fallback_prefill_tokens_per_s",
        )
    read_rate = _median_rate(read_tokens_per_s)
    if read_rate is None and fallback_read_tokens_per_s is not None:
        read_rate = _median_rate([fallback_read_tokens_per_s])
    prefill_rate = _median_rate(prefill_tokens_per_s) or fallback_prefill_tokens_per_s
    alpha = math.inf if read_rate is None else alpha_s * read_rate
    return Thresholds(alpha_tokens=alpha, beta_tokens=beta_s * prefill_rate, z_factor=z_factor)


@dataclass(frozen=True, slots=True)
class Placement:
    """One placed request. `read_side` None means no storage read: either nothing hit, or neither side's
    storage is alive, and the PE computes the whole prompt. Otherwise `read_tokens` hit tokens are read on
    `read_node`."""

    request_id: str
    pe_id: str
    de_id: str
    read_side: ReadSide | None
    read_node: int | None
    read_tokens: int


@dataclass(frozen=True, slots=True)
class RoundRobinState:
    """Cursor of the `dualpath-rr` policy, passed in and returned: the next PE / DE index (over engines sorted
    by id) and the side the next read goes to."""

    pe_cursor: int = 0
    de_cursor: int = 0
    next_side: ReadSide = ReadSide.PE


@dataclass(frozen=True, slots=True)
class PlacementRound:
    """What one scheduling round decided, in FIFO order, and the round-robin state for the next round."""

    placements: tuple[Placement, ...]
    rr_state: RoundRobinState = field(default_factory=RoundRobinState)


# ----------------------------------------------------------------------------- storage load balance (7.11)


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

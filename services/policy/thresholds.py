"""DualPath's thresholds (brief 5.2-5.3): alpha and beta in tokens, from measured read and prefill rates.

Pure code. The live router feeds it the rates its load reports carry; the simulator those of its engines.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from shared.errors import ConfigError

ALPHA_S = 3.0  # paper A.4: alpha = tokens one node can read in 3 s
BETA_S = 5.0  # paper A.4: beta = tokens one GPU can prefill in 5 s
Z_FACTOR = 1.05  # paper 6.1: DE high-token threshold multiplier
# [INF] prefill rate assumed before any PE has reported one: a conservative CPU-scale guess (tiny models on
# this machine prefill a few thousand tokens/s); measured rates replace it on the first report.
FALLBACK_PREFILL_TOKENS_PER_S = 2000.0


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

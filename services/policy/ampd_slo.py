"""AMPD's SLO attainment (brief §6.2, §8 #1): when a multi-round session meets its SLO, in one place for the
live bench (`kvpath bench ampd`) and the simulator (`loadgen/sim/ampd`).

The paper never defines attainment; it follows "the previous standard" (paper §7.1, citing vLLM, DistServe,
Orca), and DistServe counts a request as meeting its SLO when its TTFT and its *mean* time per output token
are under the thresholds. A request here is a session (paper §3: "a request (a.k.a., a session)") and "TTFT"
covers the initial and every incremental prefill (paper footnote 2), so the default is the brief §8 #1 one:
  every round's TTFT <= ttft_s, and the session's mean ITL (every token after each round's first) <= itl_s.
`itl_stat` swaps the mean for a per-session percentile of the token gaps (p90, p99), the alternatives the
brief asks to report; it needs the gaps themselves (the simulator has them, the live bench only sums).

Pure: a session is a sequence of `RoundLatency`; no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.errors import ConfigError

ITL_MEAN = "mean"  # brief §8 #1 (DistServe's mean TPOT per request)
ITL_STATS = {ITL_MEAN: 0.0, "p90": 0.90, "p99": 0.99}


@dataclass(frozen=True, slots=True)
class SessionSlo:
    """The thresholds in seconds and the ITL statistic compared with `itl_s` (one of ITL_STATS)."""

    ttft_s: float
    itl_s: float
    itl_stat: str = ITL_MEAN

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ConfigError(f"SLO ttft_s={self.ttft_s}, itl_s={self.itl_s}: must be > 0", param="slo")
        if self.itl_stat not in ITL_STATS:
            raise ConfigError(f"itl_stat {self.itl_stat!r}: one of {sorted(ITL_STATS)}", param="itl_stat")


@dataclass(frozen=True, slots=True)
class RoundLatency:
    """One round as measured: its TTFT (None: it failed), the summed gaps between its tokens after the first
    and how many there are, and optionally the gaps themselves (needed by the percentile statistics)."""

    ttft_s: float | None
    decode_s: float = 0.0
    num_gaps: int = 0
    gaps_s: Sequence[float] = ()


def session_itl(rounds: Sequence[RoundLatency], itl_stat: str = ITL_MEAN) -> float:
    """The session's ITL statistic over all its token gaps (0 without any)."""
    if itl_stat == ITL_MEAN:
        gaps = sum(r.num_gaps for r in rounds)
        return sum(r.decode_s for r in rounds) / gaps if gaps else 0.0
    values = sorted(g for r in rounds for g in r.gaps_s)
    if not values:
        return 0.0
    return values[min(len(values) - 1, math.ceil(ITL_STATS[itl_stat] * len(values)) - 1)]


def meets_slo(rounds: Sequence[RoundLatency], slo: SessionSlo) -> bool:
    """Every round succeeded within the TTFT SLO and the session's ITL statistic is within the ITL SLO."""
    if not rounds or any(r.ttft_s is None or r.ttft_s > slo.ttft_s for r in rounds):
        return False
    return session_itl(rounds, slo.itl_stat) <= slo.itl_s


def attainment(sessions: Iterable[Sequence[RoundLatency]], slo: SessionSlo) -> float:
    """Share of sessions meeting the SLO (0 for none)."""
    results = [meets_slo(rounds, slo) for rounds in sessions]
    return sum(results) / len(results) if results else 0.0

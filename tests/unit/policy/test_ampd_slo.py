"""AMPD's SLO attainment (one definition for the live bench and the simulator): every round's TTFT and the
session's ITL statistic (the mean by default, brief §8 #1) under the thresholds."""

from __future__ import annotations

import pytest

from services.policy.ampd_slo import RoundLatency, SessionSlo, attainment, meets_slo, session_itl
from shared.errors import ConfigError


def stalled_round(ttft: float = 0.1) -> RoundLatency:
    gaps = [0.01] * 99 + [1.0]  # one 1 s prefill stall among 99 steps of 10 ms
    return RoundLatency(ttft, sum(gaps), len(gaps), gaps)


def test_the_default_is_every_round_ttft_and_the_session_mean_itl() -> None:
    slo = SessionSlo(ttft_s=0.5, itl_s=0.02)
    assert slo.itl_stat == "mean"
    assert session_itl([stalled_round()]) == pytest.approx(0.0199)  # the stall spreads over 100 tokens
    assert meets_slo([stalled_round(), RoundLatency(0.2)], slo)
    assert not meets_slo([stalled_round(), RoundLatency(0.6)], slo)  # one round's TTFT is enough to miss
    assert not meets_slo([stalled_round(), RoundLatency(None)], slo)  # a failed round misses
    assert not meets_slo([], slo)


def test_percentile_statistics_see_the_stall_only_at_the_tail() -> None:
    one_stall = [stalled_round()]  # 1 gap in 100 is a stall: the mean misses 15 ms, the p99 does not
    assert not meets_slo(one_stall, SessionSlo(0.5, 0.015))
    assert meets_slo(one_stall, SessionSlo(0.5, 0.015, "p99"))
    gaps = [0.01] * 97 + [1.0] * 3  # 3 stalls in 100 gaps: the p99 is a stall, the p90 is not
    three = [RoundLatency(0.1, sum(gaps), len(gaps), gaps)]
    assert session_itl(three, "p99") == 1.0 and session_itl(three, "p90") == 0.01


def test_attainment_and_bad_specs() -> None:
    slo = SessionSlo(0.5, 0.05)
    assert attainment([[RoundLatency(0.1)], [RoundLatency(0.9)]], slo) == 0.5
    assert attainment([], slo) == 0.0
    with pytest.raises(ConfigError):
        SessionSlo(0.5, 0.05, "p50")
    with pytest.raises(ConfigError):
        SessionSlo(0.0, 0.05)

"""The router's online TTFT calibration recovers an overhead and a slowdown from (prediction, measurement)
pairs, and starts from the mean residual; a path priced off by a clear margin gets a factor of its own."""

from __future__ import annotations

import pytest

from services.policy.auto_calibration import MAX_SCALE, PathCorrection, TtftCalibration


def test_the_first_points_move_only_the_overhead() -> None:
    c = TtftCalibration(min_points=8)
    c.observe(0.10, 0.15)
    c.observe(0.20, 0.23)
    assert c.scale == 1.0 and c.overhead_s == pytest.approx(0.04)
    assert c.predict(0.1) == pytest.approx(0.14)


def test_an_overhead_and_a_slowdown_are_recovered() -> None:
    c = TtftCalibration(min_points=4)
    for raw in (0.01, 0.05, 0.1, 0.2, 0.4, 0.03, 0.3):
        c.observe(raw, 0.04 + 1.5 * raw)
    assert c.scale == pytest.approx(1.5) and c.overhead_s == pytest.approx(0.04)


def test_the_window_forgets_and_the_scale_is_bounded() -> None:
    c = TtftCalibration(window=4, min_points=2)
    for raw in (0.1, 0.2, 0.3, 0.4):
        c.observe(raw, 100 * raw)
    assert c.scale == MAX_SCALE
    for raw in (0.1, 0.2, 0.3, 0.4):
        c.observe(raw, raw)
    assert len(c.points) == 4 and c.scale == pytest.approx(1.0)
    assert c.overhead_s == pytest.approx(0.0, abs=1e-9)
    c.observe(0.1, 0.0)  # a nonsense measurement is ignored
    assert len(c.points) == 4


def test_a_path_measured_clearly_off_gets_its_factor_and_a_noisy_one_none() -> None:
    c = PathCorrection(min_points=4)
    slow = (1.5, 1.7, 1.6, 1.55, 1.65, 1.6)  # remote/hbm, as measured on P/D engines sharing two cores
    noisy = (0.6, 1.3, 0.9, 1.25, 0.7, 1.1)  # batch mates and neighbours around the price
    for i, (s, n) in enumerate(zip(slow, noisy, strict=True)):
        c.observe("remote/hbm", 0.05, 0.05 * s)
        c.observe("local/pool", 0.03, 0.03 * n)
        if i < 3:  # too few points for either
            assert c.factor("remote/hbm") == 1.0
    assert c.factor("remote/hbm") == pytest.approx(1.6, rel=0.02)
    assert c.factor("local/pool") == 1.0 and "local/pool" not in c.factors
    assert c.factor("local/hbm") == 1.0  # a path never measured


def test_a_path_correction_follows_the_path_and_is_bounded() -> None:
    c = PathCorrection(window=4, min_points=4)
    for _ in range(4):
        c.observe("remote/hbm", 0.01, 1.0)  # 100x off: bounded
    assert c.factor("remote/hbm") == MAX_SCALE
    for _ in range(4):  # the window forgets: priced right again, the factor goes
        c.observe("remote/hbm", 0.05, 0.05)
    assert c.factor("remote/hbm") == 1.0
    c.observe("remote/hbm", 0.0, 0.05)  # nonsense is ignored
    c.observe("remote/hbm", 0.05, -1.0)
    assert len(c.log_ratios["remote/hbm"]) == 4

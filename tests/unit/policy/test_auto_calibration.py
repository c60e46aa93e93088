"""The router's online TTFT calibration recovers an overhead and a slowdown from (prediction, measurement)
pairs, and starts from the mean residual."""

from __future__ import annotations

import pytest

from services.policy.auto_calibration import MAX_SCALE, TtftCalibration


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

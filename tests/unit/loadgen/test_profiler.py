"""`kvpath profile`: the piecewise fits recover known models, and a profile of the real runtime is a cost
model the router and engines load (`CostModel.from_dict` of what it wrote)."""

from __future__ import annotations

import json

import pytest

from gpu.runner import ModelRunner
from loadgen.profiler import fit_link, fit_piecewise, profile
from services.policy.ampd_costs import CostModel, prefill_features


def test_the_piecewise_fit_recovers_each_segment() -> None:
    points = [(h, i) for h in (0, 100, 400) for i in (8, 32, 64, 200, 400, 800)]

    def truth(h: int, i: int) -> float:
        a, b, c = (0.01, 1e-4, 0.0) if i < 128 else (0.002, 5e-5, 1e-8)
        return a + b * i + c * i * (h + i / 2)

    model = fit_piecewise(
        [i for _, i in points], [prefill_features(h, i) for h, i in points], [truth(h, i) for h, i in points],
        (0.0, 128.0),
    )  # fmt: skip
    assert model.coef(50) == pytest.approx((0.01, 1e-4, 0.0), abs=1e-9)
    assert model.coef(500) == pytest.approx((0.002, 5e-5, 1e-8), rel=1e-6)


def test_a_segment_without_enough_points_takes_the_fit_of_all() -> None:
    xs = [1, 2, 3, 100]
    model = fit_piecewise(xs, [(1, x) for x in xs], [1 + 2 * x for x in xs[:3]] + [300], (0.0, 50.0))
    assert model.coef(1) == pytest.approx((1.0, 2.0))  # its own three points
    assert model.coef(100)[1] == pytest.approx(2.9, rel=0.05)  # one point: the fit over all four


def test_the_link_fit_is_alpha_plus_bytes_over_bandwidth() -> None:
    link = fit_link([1e6, 2e6, 4e6], [0.001 + 1e6 / 1e9, 0.001 + 2e6 / 1e9, 0.001 + 4e6 / 1e9])
    assert link.alpha_s == pytest.approx(0.001) and link.bytes_per_s == pytest.approx(1e9)


@pytest.mark.slow
def test_a_profile_of_the_runtime_loads_as_a_cost_model() -> None:
    runner = ModelRunner.load("tiny", device="cpu", num_kv_blocks=80)
    try:
        model = profile(runner, repeats=1, max_tokens=512, link="shm")
    finally:
        runner.close()
    loaded = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert loaded.prefill_s(0, 256) > loaded.prefill_s(0, 16) > 0
    assert loaded.prefill_s(256, 256) >= loaded.prefill_s(0, 256)
    assert loaded.kv_s(1024, "shm") > 0 and loaded.kv_s(1024, "storage") > 0 and loaded.kv_s(0, "shm") == 0
    assert loaded.decode_step_s(4, 4 * 128) > 0

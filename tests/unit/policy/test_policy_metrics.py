"""alpha / beta from measured rates, and the storage max/avg balance metric (brief 7.11) by hand."""

from __future__ import annotations

import math

import pytest

from loadgen.balance import storage_balance
from services.policy.thresholds import Thresholds, thresholds_from_rates
from shared.errors import ConfigError, KvpathError


def test_thresholds_are_seconds_times_the_median_measured_rate() -> None:
    t = thresholds_from_rates([1000.0, 5000.0, 1500.0], [400.0, 600.0])  # median, not mean: 1500 not 2500
    assert (t.alpha_tokens, t.beta_tokens, t.z_factor) == (3.0 * 1500.0, 5.0 * 500.0, 1.05)


def test_unmeasured_rates_are_ignored_and_fallbacks_apply() -> None:
    t = thresholds_from_rates([0.0, float("nan"), -5.0], [], fallback_prefill_tokens_per_s=100.0)
    assert math.isinf(t.alpha_tokens)  # no read rate known: every node counts as a short queue
    assert t.beta_tokens == 500.0
    t2 = thresholds_from_rates([], [0.0, 250.0], fallback_read_tokens_per_s=1e4, alpha_s=2.0, beta_s=4.0)
    assert (t2.alpha_tokens, t2.beta_tokens) == (2e4, 1000.0)


def test_threshold_inputs_are_validated() -> None:
    with pytest.raises(ConfigError, match="alpha_s=0"):
        thresholds_from_rates(alpha_s=0)
    with pytest.raises(ConfigError, match="z_factor"):
        Thresholds(alpha_tokens=1, beta_tokens=1, z_factor=0)


def test_balance_per_window_max_over_mean() -> None:
    samples = [(0.0, 0, 0), (1.0, 0, 100), (2.0, 0, 200), (0.0, 1, 0), (1.0, 1, 300), (2.0, 1, 400)]
    report = storage_balance(samples, window_s=1.0)
    # window [0,1]: 100 vs 300 -> 300 / 200 = 1.5; window [1,2]: 100 vs 100 -> 1.0
    assert report.ratios == pytest.approx((1.5, 1.0))
    assert report.mean_ratio == pytest.approx(1.25)
    assert report.max_ratio == pytest.approx(1.5)
    assert report.num_skipped_windows == 0


def test_counters_are_interpolated_between_sparse_samples() -> None:
    samples = [(0.0, 0, 0), (2.0, 0, 200), (0.0, 1, 0), (0.5, 1, 50), (1.0, 1, 50), (2.0, 1, 250)]
    report = storage_balance(samples, window_s=1.0)
    # node 0 at t=1: 100 (linear). Window 1: 100 vs 50 -> 100/75; window 2: 100 vs 200 -> 200/150
    assert report.ratios == pytest.approx((100 / 75, 200 / 150))


def test_idle_windows_are_skipped_and_unsampled_nodes_count_as_zero() -> None:
    samples = [(0.0, 0, 0), (1.0, 0, 60), (2.0, 0, 60), (3.0, 0, 90), (0.0, 1, 0), (3.0, 1, 0)]
    report = storage_balance(samples, window_s=1.0, nodes=[0, 1, 2])
    # windows: [0,1] 60 on node 0 only -> 60 / (60/3) = 3; [1,2] no traffic: skipped; [2,3] 30 -> 3
    assert report.ratios == pytest.approx((3.0, 3.0))
    assert report.num_skipped_windows == 1


def test_lightly_loaded_windows_can_be_left_out() -> None:
    samples = [(0.0, 0, 0), (1.0, 0, 1000), (2.0, 0, 1010), (0.0, 1, 0), (1.0, 1, 1000), (2.0, 1, 1010)]
    assert storage_balance(samples, 1.0).num_skipped_windows == 0
    report = storage_balance(samples, 1.0, min_load_fraction=0.5)  # the 20-byte tail window is dropped
    assert (report.ratios, report.num_skipped_windows) == ((1.0,), 1)


def test_last_partial_window_counts() -> None:
    samples = [(0.0, 0, 0), (2.5, 0, 250), (0.0, 1, 0), (2.0, 1, 0), (2.5, 1, 50)]
    report = storage_balance(samples, window_s=1.0)
    # [2, 2.5]: node 0 50, node 1 50 -> 1.0; the earlier windows have node 1 idle -> 2.0
    assert report.ratios == pytest.approx((2.0, 2.0, 1.0))


def test_no_samples_and_bad_counters() -> None:
    report = storage_balance([], window_s=1.0)
    assert (report.ratios, report.mean_ratio, report.max_ratio) == ((), None, None)
    with pytest.raises(KvpathError, match="counter went down"):
        storage_balance([(0.0, 0, 10), (1.0, 0, 5)], window_s=1.0)
    with pytest.raises(ConfigError, match="window_s"):
        storage_balance([(0.0, 0, 10)], window_s=0)

"""AMPD's Algorithm 2 on hand-made queues: enumeration and ties, a hopeless task overtaken, the postponement
cap, no starvation under an adversarial stream; and the windowed statistics Algorithm 1 reads."""

from __future__ import annotations

import pytest

from services.policy.ampd_reorder import QueuedPrefill, next_order, overtaken, reorder, score
from services.policy.ampd_stats import EngineWindows, WindowedMean


def task(waited: float, prefill: float, slo: float = 1.0, postponed: int = 0) -> QueuedPrefill:
    return QueuedPrefill(waited_s=waited, prefill_s=prefill, ttft_slo_s=slo, num_postponed=postponed)


def test_overtaken_counts_tasks_that_something_behind_them_precedes() -> None:
    assert overtaken((0, 1, 2)) == ()
    assert overtaken((2, 1, 0)) == (0, 1)  # B keeps its index but C overtook it
    assert overtaken((1, 0, 2)) == (0,)
    assert overtaken((0, 2, 1)) == (1,)


def test_ties_keep_the_queue_order() -> None:
    window = [task(0.0, 0.1), task(0.0, 0.1), task(0.0, 0.1)]
    chosen = reorder(window)
    assert chosen.order == (0, 1, 2) and chosen.postponed == () and chosen.score == 3
    assert reorder([]).order == ()


def test_a_short_task_overtakes_a_long_one_that_is_already_hopeless() -> None:
    # the head already waited past its SLO; running it first makes the two behind it miss theirs too
    window = [task(1.5, 0.6), task(0.2, 0.3), task(0.2, 0.3)]
    assert score(window, (0, 1, 2)) == 0
    chosen = reorder(window)
    assert chosen.order == (1, 2, 0) and chosen.score == 2 and chosen.postponed == (0,)


def test_only_strict_improvements_replace_the_best_order() -> None:
    # (1, 2, 0) and (2, 1, 0) both save the two short tasks; the first enumerated of them wins
    window = [task(2.0, 0.5), task(0.0, 0.3), task(0.0, 0.3)]
    assert score(window, (1, 2, 0)) == score(window, (2, 1, 0)) == 2
    assert reorder(window).order == (1, 2, 0)


def test_a_task_at_the_postponement_cap_is_not_overtaken() -> None:
    window = [task(1.5, 0.6, postponed=3), task(0.2, 0.3), task(0.2, 0.3)]
    assert reorder(window, cap=3).order == (0, 1, 2)
    partly = [task(0.1, 0.6), task(1.5, 0.6, postponed=3), task(0.1, 0.3)]
    chosen = reorder(partly, cap=3)
    assert 1 not in chosen.postponed  # anything may pass the head, nothing may pass the capped task
    assert chosen.order.index(1) < chosen.order.index(2)


def test_no_task_starves_under_an_adversarial_stream() -> None:
    """A hopeless long task at the head and short, satisfiable tasks arriving forever: the long one runs
    after at most w postponements (plus the one task still ahead of it when its counter hits the cap)."""
    queue = [[task(5.0, 1.0), 0]]  # (task, picks it has waited through)
    picks_until_run = None
    for pick in range(50):
        queue += [[task(0.0, 0.05), 0], [task(0.0, 0.05), 0]]
        window = [q[0] for q in queue[:3]]
        chosen = next_order(window)
        for j in chosen.postponed:
            old = queue[j][0]
            queue[j][0] = task(old.waited_s, old.prefill_s, old.ttft_slo_s, old.num_postponed + 1)
        queue[:3] = [queue[k] for k in chosen.order]
        ran = queue.pop(0)
        if ran[0].prefill_s == 1.0:
            picks_until_run = pick
            break
    assert picks_until_run is not None and picks_until_run <= 3 + 1


def test_the_window_is_the_head_of_the_queue() -> None:
    queue = [task(0.0, 0.1)] * 2 + [task(0.0, 0.01)] * 5
    assert len(next_order(queue, w=3).order) == 3
    assert len(next_order(queue[:2], w=5).order) == 2
    with pytest.raises(ValueError):
        next_order(queue, w=0)


def test_windowed_means_drop_samples_older_than_the_window() -> None:
    window = WindowedMean(10.0)
    assert window.mean(0.0) == 0.0  # empty: slack
    window.add(0.0, 1.0)
    window.add(5.0, 3.0)
    assert window.mean(5.0) == pytest.approx(2.0)
    assert window.mean(10.0) == pytest.approx(2.0)  # the sample at 0.0 is still inside (10 - 10)
    assert window.mean(10.5) == pytest.approx(3.0)
    assert window.mean(15.5) == 0.0 and window.count(15.5) == 0
    window.add(20.0, 0.01, weight=4)  # one gap of 4 tokens
    window.add(20.0, 0.05, weight=1)
    assert window.mean(20.0) == pytest.approx((0.04 + 0.05) / 5)


def test_engine_windows_keep_one_mean_per_engine() -> None:
    windows = EngineWindows(10.0)
    windows.add("p0", 1.0, 0.5)
    windows.add("p1", 1.0, 1.5)
    assert (windows.mean("p0", 2.0), windows.mean("p1", 2.0), windows.mean("p9", 2.0)) == (0.5, 1.5, 0.0)
    windows.forget(["p1"])
    assert windows.mean("p0", 2.0) == 0.0 and windows.mean("p1", 2.0) == 1.5

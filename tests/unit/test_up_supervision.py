"""`kvpath up`'s restart policy: backoff doubling within the window up to its cap, a crash loop given up."""

from __future__ import annotations

from services.up.launcher import RestartPolicy


def test_backoff_doubles_within_the_window_and_resets_after_it() -> None:
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, max_restarts=5, window_s=60.0)
    exits: list[float] = []
    delays = []
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        exits.append(t)
        delays.append(policy.backoff_s(exits, t))
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]  # doubling, capped
    assert policy.backoff_s([*exits, 100.0], 100.0) == 0.5  # the old exits left the window: a fresh start


def test_a_crash_loop_is_given_up() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=10.0)
    exits = [0.0, 1.0, 2.0]
    assert policy.backoff_s(exits, 2.0) is not None
    assert policy.backoff_s([*exits, 3.0], 3.0) is None  # a fourth exit within 10 s
    assert policy.backoff_s([*exits, 30.0], 30.0) is not None  # the same count spread out is not a loop

"""Spinner (bounded, adaptive polling) and the cheap deadlines of the data plane's hot paths."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.errors import DeadlineExceededError
from shared.transport.spin import Spinner
from shared.transport.timeouts import Deadline, DeadlineWatch, fail_at


def _counting(result: bool) -> tuple[list[int], object]:
    calls = [0]

    def try_once() -> bool:
        calls[0] += 1
        return result

    return calls, try_once


def test_spinner_off_never_polls() -> None:
    calls, try_once = _counting(True)
    assert not Spinner(0.0).poll(try_once)  # type: ignore[arg-type]
    assert calls == [0]


def test_spinner_backs_off_after_misses_and_a_hit_resets_it() -> None:
    spinner = Spinner(1e-6)
    calls, never = _counting(False)
    pattern = []
    for _ in range(12):
        before = calls[0]
        spinner.poll(never)  # type: ignore[arg-type]
        pattern.append(calls[0] > before)
    # polls after 1, 2, 3, 4 misses in a row skip 0, 1, 3, 7 chances
    assert pattern == [True, True, False, True, False, False, False, True, False, False, False, False]
    assert spinner.num_misses == 4 and spinner.num_hits == 0
    _, hit = _counting(True)
    skipped = 0
    while not spinner.poll(hit):  # type: ignore[arg-type]
        skipped += 1  # the rest of the last backoff
    assert skipped == 3
    assert spinner.poll(hit) and spinner.poll(hit)  # type: ignore[arg-type]
    assert spinner.num_hits == 3  # no skips after a hit


def test_a_chance_skipped_is_used_up() -> None:
    spinner = Spinner(1e-6)
    _, miss = _counting(False)
    spinner.poll(miss)  # type: ignore[arg-type]
    spinner.poll(miss)  # type: ignore[arg-type]  # two in a row: the next chance is skipped
    assert not spinner.chance() and spinner.chance()
    assert not Spinner(0.0).chance()


def test_spinner_descheduled_past_its_budget_stops_and_backs_off() -> None:
    spinner = Spinner(1e-4)
    tries = [0]

    def descheduled() -> bool:  # the first try overruns the budget (as if the process lost its CPU)
        tries[0] += 1
        end = time.perf_counter() + 2e-4
        while time.perf_counter() < end:
            pass
        return tries[0] > 1

    assert not spinner.poll(descheduled)
    assert tries == [1] and spinner.num_misses == 1 and spinner.num_hits == 0
    tries[0] = 0
    assert not spinner.poll(descheduled)  # a second miss in a row ...
    calls, try_once = _counting(True)
    assert not spinner.poll(try_once)  # type: ignore[arg-type]
    assert calls == [0]  # ... and it backs off


def test_deadline_refuses_no_time() -> None:
    with pytest.raises(DeadlineExceededError, match="timeout_s must be > 0"):
        Deadline(0, "write to x", 0.0)


async def test_deadline_watch_fails_only_ops_past_their_deadline() -> None:
    loop = asyncio.get_running_loop()
    futures: dict[int, asyncio.Future[object]] = {1: loop.create_future(), 2: loop.create_future()}
    watch = DeadlineWatch(loop, futures)
    watch.watch(1, Deadline(30, "slow op", loop.time()))
    watch.watch(2, Deadline(0.02, "write to rx/buf", loop.time()))  # earlier: the timer is re-armed
    with pytest.raises(DeadlineExceededError, match=r"write to rx/buf: not done within 0.02 s"):
        await asyncio.wait_for(futures[2], 5)
    assert not futures[1].done()
    watch.forget(1)
    futures[1].set_result("acked")
    watch.stop()  # no timer left behind


async def test_fail_at_fails_the_future_unless_done_first() -> None:
    loop = asyncio.get_running_loop()
    late, early = loop.create_future(), loop.create_future()
    handle = fail_at(loop, late, Deadline(0.01, "wait for notice 'buf'/3", loop.time()))
    fail_at(loop, early, Deadline(0.01, "unused", loop.time()))
    early.set_result("notice")
    with pytest.raises(DeadlineExceededError, match="'buf'/3"):
        await asyncio.wait_for(late, 5)
    handle.cancel()
    assert early.result() == "notice"

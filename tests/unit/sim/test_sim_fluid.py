"""The fluid (processor-sharing) link and the event loop under it."""

from __future__ import annotations

import math

import pytest

from loadgen.sim.events import PRIORITY_LATE, EventLoop
from loadgen.sim.fluid import FluidLink
from shared.errors import ConfigError, KvpathError


def _finish_times(loop: EventLoop, link: FluidLink, starts: list[tuple[float, float]]) -> list[float]:
    """Start a flow of `size` bytes at each `(t, size)`; return when each one ended."""
    ends = [math.nan] * len(starts)

    def begin(i: int, size: float) -> None:
        link.start(size, lambda: ends.__setitem__(i, loop.now))

    for i, (t, size) in enumerate(starts):
        loop.at(t, begin, i, size)
    loop.run()
    return ends


def test_two_reads_sharing_a_link_each_get_half() -> None:
    loop = EventLoop()
    link = FluidLink(loop, 100.0)
    # alone, 100 bytes take 1 s; together each moves at 50 B/s
    assert _finish_times(loop, link, [(0.0, 100.0), (0.0, 100.0)]) == pytest.approx([2.0, 2.0])
    assert link.bytes_moved() == pytest.approx(200.0)


def test_a_late_flow_slows_the_first_then_runs_alone() -> None:
    loop = EventLoop()
    link = FluidLink(loop, 100.0)
    # A alone for 0.5 s (50 B), then A and B at 50 B/s each: A's last 50 B end at 1.5 s, B has 150 B left
    # and runs alone at 100 B/s: 3.0 s
    assert _finish_times(loop, link, [(0.0, 100.0), (0.5, 200.0)]) == pytest.approx([1.5, 3.0])


def test_bytes_moved_between_events_is_linear() -> None:
    loop = EventLoop()
    link = FluidLink(loop, 10.0)
    seen: list[float] = []
    loop.at(0.0, link.start, 100.0, lambda: None)
    loop.at(2.5, lambda: seen.append(link.bytes_moved()), priority=PRIORITY_LATE)
    loop.run()
    assert seen == pytest.approx([25.0]) and link.bytes_moved() == pytest.approx(100.0)


def test_max_active_queues_the_rest_in_fifo_order() -> None:
    loop = EventLoop()
    link = FluidLink(loop, 100.0, max_active=1)
    ends = _finish_times(loop, link, [(0.0, 100.0), (0.0, 50.0), (0.0, 100.0)])
    assert ends == pytest.approx([1.0, 1.5, 2.5])
    assert link.num_active == 0 and link.num_waiting == 0


def test_infinite_capacity_and_empty_flows_end_at_once() -> None:
    loop = EventLoop()
    link = FluidLink(loop, math.inf)
    assert _finish_times(loop, link, [(1.0, 1e12), (2.0, 0.0)]) == [1.0, 2.0]
    assert link.bytes_moved() == 1e12


def test_link_and_loop_reject_nonsense() -> None:
    loop = EventLoop()
    with pytest.raises(ConfigError, match="capacity"):
        FluidLink(loop, 0.0)
    loop.at(1.0, lambda: None)
    loop.run()
    with pytest.raises(KvpathError, match="past"):
        loop.at(0.5, lambda: None)


def test_same_instant_events_run_by_priority_then_order() -> None:
    loop = EventLoop()
    order: list[str] = []
    loop.at(1.0, order.append, "late", priority=PRIORITY_LATE)
    loop.at(1.0, order.append, "a")
    loop.at(1.0, order.append, "b")
    loop.at(0.5, order.append, "first")
    loop.run(until_s=2.0)
    assert order == ["first", "a", "b", "late"] and loop.num_events == 4


def test_a_flow_shorter_than_the_clock_resolution_still_ends() -> None:
    # at t = 1e9 s a double resolves ~1.2e-7 s; 1 kB at 1 TB/s takes 1e-9 s: the timer cannot move the clock,
    # so the remainder must count as done instead of re-arming forever
    loop = EventLoop()
    link = FluidLink(loop, 1e12)
    ends = _finish_times(loop, link, [(1e9, 1000.0), (1e9, 3000.0)])
    assert ends == [1e9, 1e9] and loop.num_events < 10

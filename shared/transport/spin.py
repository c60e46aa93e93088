"""Bounded, adaptive busy-polling of a socket, for the latency-bound case of one op in flight.

Sleeping in the event loop for a reply that comes back within tens of microseconds costs a wakeup on each
side (~100 us on a busy VM). Polling for it avoids that, but only pays off when the peer runs at the same
time on another core. On a loaded 2-core machine, polling that never gives up backfires (measured, README
"Hot paths, issue 17"): the poller holds a CPU the peer needs, and the reply it waits for comes only after
the poller's time slice ran out, so each write took 0.4-1.5 ms instead of ~0.2 ms; yielding the CPU
between tries (`sched_yield`) made it worse (a process that never sleeps loses the scheduler's wakeup
preference). So a `Spinner`:
- polls for at most `budget_s` per call (the event loop is blocked that long at most);
- backs off when polling does not pay: after k misses in a row (nothing within the budget, or this
  process descheduled past it between two tries) it skips the next 2**(k-1) - 1 chances (at most
  `_MAX_SKIPS`: a lone miss, e.g. a large tcp payload, costs nothing); one hit resets it. On a loaded
  machine it thus polls for about one op in 64. (A back-off on the share of polls that miss, not only
  misses in a row, was tried: it saved ~4% of a write's time beside a CPU-bound neighbour, but with 2-3
  senders streaming to one receiver on two cores, where polls miss often yet still pay, it cut the
  receiver's throughput from 0.49 to 0.29 GB/s; README "Hot paths".)
"""

from __future__ import annotations

import time
from collections.abc import Callable

_MAX_MISS_SHIFT = 7
_MAX_SKIPS = (1 << (_MAX_MISS_SHIFT - 1)) - 1


class Spinner:
    __slots__ = ("_misses", "_skips_left", "budget_s", "num_hits", "num_misses")

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self._misses = 0
        self._skips_left = 0
        self.num_hits = 0  # polls whose wait ended by a try started within the budget
        self.num_misses = 0  # polls that ran out of budget

    def poll(self, try_once: Callable[[], bool]) -> bool:
        """Call `try_once` until it returns True (then True) or the budget is spent (then False); False at
        once when spinning is off or backing off. `try_once` must not block."""
        return self.chance() and self.spin(try_once)

    def chance(self) -> bool:
        """One chance to poll: True when polling is on and not backing off (a chance skipped is used up).
        A caller that must do work to get ready for a poll asks this first, then calls `spin`."""
        if not self.budget_s:
            return False
        if self._skips_left:
            self._skips_left -= 1
            return False
        return True

    def spin(self, try_once: Callable[[], bool]) -> bool:
        """The poll itself (`poll` without the back-off check)."""
        now = time.perf_counter()
        end = now + self.budget_s
        while True:
            if try_once():  # a try that started within the budget: a hit
                self._misses = 0
                self.num_hits += 1
                return True
            now = time.perf_counter()
            if now > end:  # out of budget, or descheduled past it between two tries
                break
        self.num_misses += 1
        self._misses = min(self._misses + 1, _MAX_MISS_SHIFT)
        self._skips_left = min((1 << (self._misses - 1)) - 1, _MAX_SKIPS)
        return False

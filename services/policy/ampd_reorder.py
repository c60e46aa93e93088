"""AMPD's Algorithm 2 (brief §4.3): TTFT-aware reordering of a prefill queue, with a postponement cap.

Whenever an engine picks its next prefill (a prefill engine from its queue, a decode engine from its local
queue), the first `w` queued tasks are tried in every order; an order's score S (Eq. 4) counts the tasks
that would still meet their TTFT SLO if run in that order, each task's completion being the sum of the
estimated prefill times before and including it (Eq. 3). The first order with the highest score wins
(orders are enumerated identity first, so ties keep FCFS), except that an order may not postpone a task
that has been postponed `cap` times already (the starvation guard). "Postponed" means overtaken: a task
that was behind it now runs before it (brief §8 #5). The chosen order's postponed tasks count one more.

Each task carries its own TTFT SLO (a per-request field), a generalization of the paper's one threshold.
Pure: the caller passes how long each task has waited and its estimated prefill time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

WINDOW = 3  # paper §7.1: w = 3, also the postponement cap


@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """One queued prefill as Algorithm 2 sees it: waited_s = T_now - T_enq, prefill_s = t_pre (Eq. 3)."""

    waited_s: float
    prefill_s: float
    ttft_slo_s: float
    num_postponed: int = 0


@dataclass(frozen=True, slots=True)
class Reordering:
    """`order`: indices of the window's tasks in their new order (order[0] runs next); `postponed`: the
    window indices overtaken in it (their counters go up by one); `score`: S of the order (Eq. 4)."""

    order: tuple[int, ...]
    postponed: tuple[int, ...]
    score: int


def overtaken(order: Sequence[int]) -> tuple[int, ...]:
    """Window indices that some task originally behind them precedes in `order`."""
    position = {task: k for k, task in enumerate(order)}
    return tuple(
        j for j in range(len(order)) if any(position[i] < position[j] for i in range(j + 1, len(order)))
    )


def score(window: Sequence[QueuedPrefill], order: Sequence[int]) -> int:
    """Eq. 4: tasks whose wait plus completion (Eq. 3: prefill times up to and including theirs) fits their
    TTFT SLO."""
    done_s, met = 0.0, 0
    for k in order:
        task = window[k]
        done_s += task.prefill_s
        met += task.waited_s + done_s <= task.ttft_slo_s
    return met


def reorder(window: Sequence[QueuedPrefill], cap: int = WINDOW) -> Reordering:
    """Algorithm 2, lines 1-7, over the head of a queue (`window` = Q.peek(w), in queue order)."""
    n = len(window)
    best: Reordering | None = None
    for order in itertools.permutations(range(n)):  # identity first: FCFS wins ties
        postponed = overtaken(order)
        if any(window[j].num_postponed >= cap for j in postponed):
            continue
        s = score(window, order)
        if best is None or s > best.score:
            best = Reordering(order, postponed, s)
    assert best is not None or n == 0  # the identity postpones nobody
    return best or Reordering((), (), 0)


def next_order(queue: Sequence[QueuedPrefill], w: int = WINDOW, cap: int | None = None) -> Reordering:
    """The reordering of the queue's head (its first `w` tasks) that Algorithm 2 picks; `cap` defaults to w
    (the paper uses one number for both)."""
    if w < 1:
        raise ValueError(f"reorder window w={w}: must be >= 1")
    return reorder(queue[:w], w if cap is None else cap)

"""Shortest prefill first, with a bounded detour: which waiting prefill an engine admits next
(`--prefill-order short-first`).

An agent's later turn re-reads a context whose KV is cached or stored and computes only its new tokens; a
cold prompt computes all of them. First come, first served makes the warm turn wait behind every cold
prompt queued before it (8 SmolLM2 sessions starting 3,000-token contexts together: a second turn waited
45 s for 132 tokens of compute). Served shortest first, the warm turn goes ahead.

The bound is in compute, not in turns: a prefill lets shorter ones go ahead of it (queued after it and
admitted first, or admitted while it is partly prefilled) for at most `ratio` times its own compute tokens;
past that nothing passes it. So reordering at most adds `ratio` x its own prefill time to any prefill's
wait, while a cold prompt can still let dozens of 100-token turns by (a bound on the count of overtakes,
as AMPD's Algorithm 2 uses, was spent by the many short turns within seconds: measured, 24 s turns again).

The same rule orders a queue the router holds (DualPath's placement queue, `short_first_order`): a
round places a prefix of the order, and the tasks the placed ones passed are postponed by them
(`postponements`). Past beta (every PE over it), a request still goes to a PE that orders its own queue
shortest first when what that PE runs before it (`work_ahead`) takes under beta_s of its compute: beta
bounds the wait a PE adds to a request, and there that is the shorter prefills' and one step's, not the
cold prompt's in flight (`PrefillQueue`, `past_beta_prefix`).

Pure: the caller passes each task's tokens and what has passed it so far.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.policy.snapshot import Placement

RATIO = 1.0  # default: shorter prefills may pass a prefill for up to its own compute
SCAN = 64  # a long queue is ordered by its head: ordering stays O(SCAN^2), whatever the queue's length
# requests a placement round tries past beta, in its order (one more round, with beta lifted, over them); the
# rest wait for the next round
PAST_BETA_TRIES = 8


@dataclass(frozen=True, slots=True)
class WaitingPrefill:
    tokens_left: int  # prompt tokens still to compute (stored or cached prefix tokens excluded)
    tokens_total: int  # its whole compute (prompt tokens less the prefix it loads)
    postponed_tokens: int = 0  # compute admitted ahead of it so far


def closed(task: WaitingPrefill, ratio: float = RATIO) -> bool:
    """Nothing may pass `task` any more: shorter prefills took its whole allowance."""
    return task.postponed_tokens >= ratio * task.tokens_total


def next_shortest(queue: Sequence[WaitingPrefill], ratio: float = RATIO) -> int:
    """Index of the task to admit next: the fewest tokens left among the tasks up to and including the first
    `closed` one (none may pass it), the earliest of equals. The tasks before the chosen one are the ones it
    passes: each is postponed by its `tokens_left`."""
    best = 0
    for i, task in enumerate(queue):
        if task.tokens_left < queue[best].tokens_left:
            best = i
        if closed(task, ratio):
            break
    return best


def num_passing(
    waiting: Sequence[WaitingPrefill], partials: Sequence[WaitingPrefill], ratio: float = RATIO
) -> int:
    """How many of `waiting` (in the order they are offered) go ahead of the partly prefilled `partials`:
    while the next has fewer tokens left than each of them and none of them is `closed`, counting the
    passes before it."""
    passed = 0
    for k, task in enumerate(waiting):
        for p in partials:
            if p.tokens_left <= task.tokens_left or p.postponed_tokens + passed >= ratio * p.tokens_total:
                return k  # not shorter, or `closed` once the ones before it passed
        passed += task.tokens_left
    return len(waiting)


def short_first_order(queue: Sequence[WaitingPrefill], ratio: float = RATIO, scan: int = SCAN) -> list[int]:
    """The order to offer `queue` (arrival order) in: `next_shortest` over its first `scan` tasks, again
    over what is left after each pick, each pick postponing the tasks it passes as it would if placed;
    the tasks past `scan` follow in arrival order."""
    head = min(len(queue), scan)
    left = [task.tokens_left for task in queue[:head]]
    postponed = [float(task.postponed_tokens) for task in queue[:head]]
    allowance = [ratio * task.tokens_total for task in queue[:head]]
    rest = list(range(head))
    order: list[int] = []
    while rest:
        best = 0
        for k, i in enumerate(rest):
            if left[i] < left[rest[best]]:
                best = k
            if postponed[i] >= allowance[i]:
                break
        for i in rest[:best]:
            postponed[i] += left[rest[best]]
        order.append(rest.pop(best))
    return order + list(range(head, len(queue)))


def postponements(queue: Sequence[WaitingPrefill], placed: Sequence[int]) -> list[int]:
    """Compute tokens each task of `queue` (arrival order) is passed by when the tasks at the indices
    `placed` are placed, in that order: a placed task passes every earlier arrival not placed before it."""
    added = [0] * len(queue)
    done: set[int] = set()
    for j in placed:
        done.add(j)
        for i in range(j):
            if i not in done:
                added[i] += queue[j].tokens_left
    return added


def work_ahead(left_tokens: Sequence[int], num_prefills: int, tokens: int) -> int | None:
    """Compute tokens an engine that orders its prefills shortest first runs before a new prefill of
    `tokens`: its unfinished prefills with no more tokens left (the earlier of equals go first).
    `left_tokens` are the fewest tokens left of its prefills, ascending, `num_prefills` how many it has in
    all; None when the list ends before a prefill longer than `tokens` (the rest is unknown)."""
    total = 0
    for left in left_tokens:
        if left > tokens:
            return total
        total += left
    return total if len(left_tokens) >= num_prefills else None


@dataclass(slots=True)
class PrefillQueue:
    """A short-first PE's queue as its load report lists it (with what was sent to it since): the tokens
    left of its prefills (the fewest, ascending), how many prefills in all, and the compute tokens it runs
    within beta_s."""

    left: list[int]
    count: int
    limit: float

    def takes(self, tokens: int) -> bool:
        """A prefill of `tokens` would wait there for under beta_s of compute."""
        ahead = work_ahead(self.left, self.count, tokens)
        return ahead is not None and ahead <= self.limit

    def add(self, tokens: int) -> None:
        bisect.insort(self.left, tokens)
        self.count += 1


def past_beta_prefix(
    placements: Sequence[Placement],
    tokens: Mapping[str, int],
    queue_of: Callable[[str], PrefillQueue | None],
) -> int:
    """How many of `placements` (a round's with beta lifted, in its order) stand: each on a PE whose
    short-first queue (`queue_of`: None for a PE that does not order so) takes its request's `tokens`
    (request id -> compute tokens) with the ones before it added; the first that does not ends them, as
    each placement of a round counted the ones before it."""
    queues: dict[str, PrefillQueue | None] = {}
    for n, placement in enumerate(placements):
        if placement.pe_id not in queues:
            queues[placement.pe_id] = queue_of(placement.pe_id)
        queue, need = queues[placement.pe_id], tokens[placement.request_id]
        if queue is None or not queue.takes(need):
            return n
        queue.add(need)
    return len(placements)

"""One placement round: the function the live router's dispatcher and the simulator's scheduler both call.

Inputs are a snapshot of the engines and nodes, the FIFO of waiting requests (head first), the thresholds and
the state carried from the previous round; the output is the placements (a FIFO prefix of the queue), the
state for the next round, and why nothing was placed when nothing could be. Pure: no clock, no I/O. The
live router (`services/router/load_sync.py`) and the simulator each keep a `LoadTable` up to date between
rounds and pass it (`place_table_round`), so a round costs what it places, not what the cluster holds;
`place_round` builds a fresh table from snapshots (tests, one-off callers). Both run the policies of
`table_placement.py`, which decide what the reference rules (`tests/reference_placement.py`) decide.

Three things beyond the policy itself, none of which changes a decision:
* Missing roles: with no live prefill or decode engine nothing can be placed; the result says which role is
  missing, so the live router fails its waiters at once (503) instead of at their deadline.
* Skipped rounds: when the FIFO's head fits nowhere (no PE under beta, or no DE with room for it), every
  policy places nothing, so `place` is not called (`is_skipped`).
* A window at the head of the FIFO instead of all of it. Placements are a FIFO prefix, and under `dualpath` /
  `basic` everything after the PE stage looks only at the requests that got a PE, so the window's result
  equals the whole queue's unless the PE stage used the whole window; then the window doubles and the round
  is redone. Under `dualpath-rr` each request depends only on those before it, so a window that is not fully
  placed is exact too. The window adapts to recent rounds (`RoundState.window`). `tests/unit/sim` checks the
  equality.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import islice

from services.policy.load_table import LoadTable
from services.policy.snapshot import (
    ROLE_DECODE,
    ROLE_PREFILL,
    EngineSnapshot,
    NodeSnapshot,
    PendingRequest,
    Placement,
    ReadSide,
    RoundRobinState,
)
from services.policy.table_placement import place_window
from services.policy.thresholds import Thresholds
from shared.errors import KvpathError

MIN_WINDOW = 64


@dataclass(frozen=True, slots=True)
class RoundState:
    """Carried from round to round: the round-robin cursors and the FIFO window size."""

    rr: RoundRobinState = field(default_factory=RoundRobinState)
    window: int = MIN_WINDOW


@dataclass(frozen=True, slots=True)
class RoundResult:
    """`placements` in FIFO order (the caller removes them from its queue); `missing_roles` non-empty: no live
    engine of that role, nothing can be placed until one reports; `is_skipped`: the head fits nowhere now."""

    placements: tuple[Placement, ...]
    state: RoundState
    missing_roles: tuple[str, ...] = ()
    is_skipped: bool = False


def place_round(
    policy: str,
    engines: tuple[EngineSnapshot, ...],
    nodes: tuple[NodeSnapshot, ...],
    queue: Collection[PendingRequest],
    thresholds: Thresholds,
    state: RoundState,
    *,
    force_read_side: str = "",
) -> RoundResult:
    """One round of a disaggregated `policy` over snapshots (a fresh table: tests and one-off callers)."""
    table = LoadTable.of(engines, nodes)
    return place_table_round(policy, table, queue, thresholds, state, force_read_side=force_read_side)


def place_table_round(
    policy: str,
    table: LoadTable,
    queue: Collection[PendingRequest],
    thresholds: Thresholds,
    state: RoundState,
    *,
    force_read_side: str = "",
) -> RoundResult:
    """One round of a disaggregated `policy` (one of `placement.POLICIES`) over `queue` (head first).

    `force_read_side` ("pe" | "de", experiments): read on that side whenever its node's storage is alive.
    """
    missing = _missing_roles(table)
    if missing:
        return RoundResult((), state, missing_roles=missing)
    head = next(iter(queue), None)
    if head is None:
        return RoundResult((), state)
    if not _can_place(head, table, thresholds):
        return RoundResult((), state, is_skipped=True)
    window = state.window
    while True:
        requests = tuple(islice(queue, window))
        _require_unique(requests)
        is_partial = len(requests) < len(queue)
        result = place_window(policy, table, requests, thresholds, state.rr, is_partial=is_partial)
        if result is not None:
            break
        window *= 2
    placements = result.placements
    if force_read_side:
        placements = tuple(_forced(p, table, ReadSide(force_read_side)) for p in placements)
    next_window = max(MIN_WINDOW, 2 * len(placements), window // 2)
    return RoundResult(placements, RoundState(result.rr_state, next_window))


def _missing_roles(table: LoadTable) -> tuple[str, ...]:
    return tuple(role for role in (ROLE_PREFILL, ROLE_DECODE) if not table.has_live(role))


def _can_place(head: PendingRequest, table: LoadTable, thresholds: Thresholds) -> bool:
    """False only when no policy could place the FIFO head now: no PE under beta, or no DE with room."""
    return table.has_prefill_at_most(thresholds.beta_tokens) and table.has_decode_room(head.hbm_need_tokens)


def _require_unique(requests: tuple[PendingRequest, ...]) -> None:
    if len({r.request_id for r in requests}) != len(requests):
        raise KvpathError("inconsistent scheduling snapshot: duplicate request ids in the queue")


def _forced(placement: Placement, table: LoadTable, side: ReadSide) -> Placement:
    """`placement` reading on `side` instead, when it reads at all and that side's storage is alive."""
    if placement.read_side is None or placement.read_side is side:
        return placement
    engine_id = placement.pe_id if side is ReadSide.PE else placement.de_id
    node = table.nodes[table.row_of[engine_id]]
    if not table.is_storage_alive[node]:
        return placement
    return dataclasses.replace(placement, read_side=side, read_node=node)

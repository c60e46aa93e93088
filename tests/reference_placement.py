"""Inter-engine placement (brief 5.2-5.4): which PE and DE serve a queued request, which side reads its KV.

Pure code over a `ClusterSnapshot` (`services/policy/snapshot.py`); a round decides as many requests as
can be placed now and returns them as a FIFO prefix of the queue. This module is the rules as written and
the reference: `services/policy/round.py` runs a round for the live router and the simulator alike with
`table_placement.py`, the same rules over a `LoadTable` updated in place (tests check equal decisions).
Three disaggregated policies share the rules:

* `dualpath`: PE by alpha/beta categories and fewest tokens, DE by the two-level rule with threshold Z, read
  side = the shorter node read queue.
* `basic` (the paper's baseline): PE by fewest tokens among PEs under beta (no alpha categories), DE by the
  same two-level rule (so the comparison isolates the read path), read side always the PE's node.
* `dualpath-rr` (load-balance / ablation baseline): round-robin PEs and DEs, alternating read sides.

Choices the paper leaves open ([GAP] in the brief), decided here:
* The whole cluster fetches at once: PE choice is over every PE (the paper runs it per fetching PE group; one
  global round is the same as all groups fetching together, and balances better than group after group).
* Stages run as in the paper: PE selection over the FIFO, then DE selection over the requests that got a PE,
  then read sides in FIFO order. PE categories therefore use the reported read queues (brief 5.2 [INF]); each
  read-side decision adds its hit tokens to the chosen node's queue, so later read-side decisions see it.
* Placements are a FIFO prefix: the first request that gets no PE or no DE ends the round (it and everything
  behind it stay queued), although the paper's DE stage alone does not keep FIFO.
* Draining engines get nothing. A node whose storage is down is never a read side; a request with no live side
  (or no hit) is placed with `read_side=None` and recomputes its prefix.
* Ties break deterministically: on the other load measure (tokens or requests), then on the smaller id.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from services.policy.snapshot import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ClusterSnapshot,
    EngineSnapshot,
    PendingRequest,
    Placement,
    PlacementRound,
    ReadSide,
    RoundRobinState,
)
from services.policy.table_placement import POLICIES
from services.policy.thresholds import Thresholds
from shared.errors import ConfigError


@dataclass(slots=True)
class _Loads:
    """Working copy of the loads a round updates as it assigns (flat, id-keyed)."""

    tokens: dict[str, int]
    requests: dict[str, int]
    free_kv: dict[str, int]
    read_queue: dict[int, int]
    is_alive: dict[int, bool]

    @classmethod
    def of(cls, snapshot: ClusterSnapshot) -> _Loads:
        return cls(
            tokens={e.engine_id: e.unfinished_tokens for e in snapshot.engines},
            requests={e.engine_id: e.num_unfinished for e in snapshot.engines},
            free_kv={e.engine_id: e.free_kv_tokens for e in snapshot.engines},
            read_queue={n.node: n.read_queue_tokens for n in snapshot.nodes},
            is_alive={n.node: n.is_storage_alive for n in snapshot.nodes},
        )

    def assign(self, engine_id: str, request: PendingRequest, *, uses_kv: bool) -> None:
        self.tokens[engine_id] += request.prompt_tokens
        self.requests[engine_id] += 1
        if uses_kv:
            self.free_kv[engine_id] -= request.hbm_need_tokens


def _active(snapshot: ClusterSnapshot, role: str) -> list[EngineSnapshot]:
    return [e for e in snapshot.with_role(role) if not e.is_draining]


# ------------------------------------------------------------------------------------------ PE (5.2)


def select_prefill_engines(
    snapshot: ClusterSnapshot, thresholds: Thresholds, *, use_read_queue_categories: bool = True
) -> tuple[str, ...]:
    """PE ids for the longest FIFO prefix of the queue that can get a PE (brief 5.2).

    Category 1 (tokens > beta) gets nothing; among the rest, engines on nodes whose reported read queue is
    <= alpha (category 2) beat the others (category 3; a node whose storage is down counts here, since its
    idle SNIC cannot be used anyway); fewest unfinished tokens wins (then fewer requests, then the smaller
    id), and the winner's tokens and request count grow before the next request. Without
    `use_read_queue_categories` (policy `basic`) all engines under beta form one pool.
    """
    is_short = {
        n.node: n.is_storage_alive and n.read_queue_tokens <= thresholds.alpha_tokens for n in snapshot.nodes
    }
    # One heap per category, keyed (tokens, requests, id). Loads only grow within a round, so an engine that
    # crosses beta leaves for good and a node's category (from the reported queue) never changes.
    short: list[tuple[int, int, str]] = []
    long: list[tuple[int, int, str]] = []
    for e in _active(snapshot, ROLE_PREFILL):
        if e.unfinished_tokens <= thresholds.beta_tokens:
            is_preferred = is_short[e.node] or not use_read_queue_categories
            (short if is_preferred else long).append((e.unfinished_tokens, e.num_unfinished, e.engine_id))
    heapq.heapify(short)
    heapq.heapify(long)
    chosen: list[str] = []
    for request in snapshot.queue:
        pool = short or long
        if not pool:
            break
        tokens, requests, engine_id = pool[0]
        chosen.append(engine_id)
        if tokens + request.prompt_tokens <= thresholds.beta_tokens:
            heapq.heapreplace(pool, (tokens + request.prompt_tokens, requests + 1, engine_id))
        else:
            heapq.heappop(pool)  # now category 1
    return tuple(chosen)


# ------------------------------------------------------------------------------------------ DE (5.3)


def assign_decode_groups(
    requests: Sequence[PendingRequest], snapshot: ClusterSnapshot
) -> dict[str, list[PendingRequest]]:
    """Phase 1: each request, in order, to the DE group with the least total unfinished tokens (updated after
    every assignment); returns each group's private queue. Totals count the group's non-draining DEs only."""
    totals: dict[str, int] = {}
    for engine in _active(snapshot, ROLE_DECODE):
        totals[engine.group] = totals.get(engine.group, 0) + engine.unfinished_tokens
    queues: dict[str, list[PendingRequest]] = {group: [] for group in totals}
    heap = [(total, group) for group, total in totals.items()]
    heapq.heapify(heap)
    for request in requests:
        if not heap:
            break
        total, group = heap[0]
        heapq.heapreplace(heap, (total + request.prompt_tokens, group))
        queues[group].append(request)
    return queues


def high_token_threshold(
    private_queue: Sequence[PendingRequest], engines: Sequence[EngineSnapshot], z_factor: float
) -> float:
    """Z = z_factor * (sum of len_r over R + sum of tok_e) / |E|, where R is the longest prefix of the private
    queue whose HBM needs fit the group's total free HBM (fragmentation ignored)."""
    hbm_left = sum(e.free_kv_tokens for e in engines)
    fitting_tokens = 0
    for request in private_queue:
        if request.hbm_need_tokens > hbm_left:
            break
        hbm_left -= request.hbm_need_tokens
        fitting_tokens += request.prompt_tokens
    return z_factor * (fitting_tokens + sum(e.unfinished_tokens for e in engines)) / len(engines)


def _place_in_group(
    private_queue: Sequence[PendingRequest], engines: Sequence[EngineSnapshot], z_factor: float
) -> dict[str, str]:
    """Phase 2 inside one group: low set (tok + len_r <= Z) -> fewest requests, else high set -> fewest
    tokens, among DEs with room for hbm_need; the first request no DE has room for ends the group's round."""
    z_tokens = high_token_threshold(private_queue, engines, z_factor)
    tokens = {e.engine_id: e.unfinished_tokens for e in engines}
    requests = {e.engine_id: e.num_unfinished for e in engines}
    free_kv = {e.engine_id: e.free_kv_tokens for e in engines}
    placed: dict[str, str] = {}
    for request in private_queue:
        fits = [e.engine_id for e in engines if free_kv[e.engine_id] >= request.hbm_need_tokens]
        if not fits:
            break
        low = [e for e in fits if tokens[e] + request.prompt_tokens <= z_tokens]
        if low:
            best = min(low, key=lambda e: (requests[e], tokens[e], e))
        else:
            best = min(fits, key=lambda e: (tokens[e], requests[e], e))
        tokens[best] += request.prompt_tokens
        requests[best] += 1
        free_kv[best] -= request.hbm_need_tokens
        placed[request.request_id] = best
    return placed


def select_decode_engines(
    requests: Sequence[PendingRequest], snapshot: ClusterSnapshot, z_factor: float
) -> tuple[str | None, ...]:
    """Two-level DE choice (brief 5.3) for `requests` in order; None where the request's group had no room."""
    members: dict[str, list[EngineSnapshot]] = {}
    for engine in _active(snapshot, ROLE_DECODE):
        members.setdefault(engine.group, []).append(engine)
    placed: dict[str, str] = {}
    for group, private_queue in assign_decode_groups(requests, snapshot).items():
        placed.update(_place_in_group(private_queue, members[group], z_factor))
    return tuple(placed.get(r.request_id) for r in requests)


# ------------------------------------------------------------------------------------ read side (5.4)


def choose_read_side(
    pe_node: int, de_node: int, read_queue_tokens: Mapping[int, int], is_storage_alive: Mapping[int, bool]
) -> ReadSide | None:
    """The side whose node has the shorter read queue (tie: PE); a node with dead storage is never chosen;
    None when neither side can read."""
    sides = [(s, n) for s, n in ((ReadSide.PE, pe_node), (ReadSide.DE, de_node)) if is_storage_alive[n]]
    if not sides:
        return None
    return min(sides, key=lambda s: read_queue_tokens[s[1]])[0]  # min keeps the first (PE) on a tie


def _placement(
    request: PendingRequest, pe: EngineSnapshot, de: EngineSnapshot, side: ReadSide | None, loads: _Loads
) -> Placement:
    """Build the decision and enqueue its read on the chosen node, so later decisions see it."""
    node = None if side is None else (pe.node if side is ReadSide.PE else de.node)
    if node is None or request.hit_tokens == 0:
        return Placement(request.request_id, pe.engine_id, de.engine_id, None, None, 0)
    loads.read_queue[node] += request.hit_tokens
    return Placement(request.request_id, pe.engine_id, de.engine_id, side, node, request.hit_tokens)


# ------------------------------------------------------------------------------------------ policies


def _place_staged(
    snapshot: ClusterSnapshot, thresholds: Thresholds, *, is_dualpath: bool
) -> tuple[Placement, ...]:
    pe_ids = select_prefill_engines(snapshot, thresholds, use_read_queue_categories=is_dualpath)
    head = snapshot.queue[: len(pe_ids)]
    de_ids = select_decode_engines(head, snapshot, thresholds.z_factor)
    by_id = {e.engine_id: e for e in snapshot.engines}
    loads = _Loads.of(snapshot)
    placements: list[Placement] = []
    for request, pe_id, de_id in zip(head, pe_ids, de_ids, strict=True):
        if de_id is None:
            break
        pe, de = by_id[pe_id], by_id[de_id]
        if is_dualpath:
            side = choose_read_side(pe.node, de.node, loads.read_queue, loads.is_alive)
        else:
            side = ReadSide.PE if loads.is_alive[pe.node] else None  # Basic: PE SNICs only
        placements.append(_placement(request, pe, de, side, loads))
    return tuple(placements)


def place_dualpath(snapshot: ClusterSnapshot, thresholds: Thresholds) -> tuple[Placement, ...]:
    """The full DualPath scheduler: PE (5.2), DE (5.3), read side (5.4)."""
    return _place_staged(snapshot, thresholds, is_dualpath=True)


def place_basic(snapshot: ClusterSnapshot, thresholds: Thresholds) -> tuple[Placement, ...]:
    """The paper's Basic: fewest-tokens PE under beta, the same DE rule, reads only on the PE's node."""
    return _place_staged(snapshot, thresholds, is_dualpath=False)


def _at_most(values: Mapping[str, int], limit: float, engine_id: str) -> bool:
    return values[engine_id] <= limit


def _at_least(values: Mapping[str, int], floor: float, engine_id: str) -> bool:
    return values[engine_id] >= floor


def _next_in_ring(
    ring: Sequence[EngineSnapshot], cursor: int, is_eligible: Callable[[str], bool]
) -> int | None:
    """Index of the first eligible engine from `cursor` on, cyclically; None when none is."""
    for step in range(len(ring)):
        index = (cursor + step) % len(ring)
        if not ring[index].is_draining and is_eligible(ring[index].engine_id):
            return index
    return None


def _rr_side(pe: EngineSnapshot, de: EngineSnapshot, wanted: ReadSide, loads: _Loads) -> ReadSide | None:
    other = ReadSide.DE if wanted is ReadSide.PE else ReadSide.PE
    node_of = {ReadSide.PE: pe.node, ReadSide.DE: de.node}
    return next((s for s in (wanted, other) if loads.is_alive[node_of[s]]), None)


def place_round_robin(
    snapshot: ClusterSnapshot, thresholds: Thresholds, state: RoundRobinState
) -> PlacementRound:
    """`dualpath-rr`: PEs and DEs in turn (engines sorted by id), read sides alternating PE, DE, PE, ...

    Only hard limits are kept: beta (else the router would hand out its whole queue at once), DE HBM room, and
    no reads on dead storage (the other side is used instead). The wanted side flips after every request that
    reads, whichever side it finally read on.
    """
    loads = _Loads.of(snapshot)
    pes = sorted(snapshot.with_role(ROLE_PREFILL), key=lambda e: e.engine_id)
    des = sorted(snapshot.with_role(ROLE_DECODE), key=lambda e: e.engine_id)
    pe_cursor, de_cursor, next_side = state.pe_cursor, state.de_cursor, state.next_side
    placements: list[Placement] = []
    for request in snapshot.queue:
        pe_index = _next_in_ring(pes, pe_cursor, partial(_at_most, loads.tokens, thresholds.beta_tokens))
        de_index = _next_in_ring(des, de_cursor, partial(_at_least, loads.free_kv, request.hbm_need_tokens))
        if pe_index is None or de_index is None:
            break
        pe, de = pes[pe_index], des[de_index]
        loads.assign(pe.engine_id, request, uses_kv=False)
        loads.assign(de.engine_id, request, uses_kv=True)
        pe_cursor, de_cursor = pe_index + 1, de_index + 1
        placement = _placement(request, pe, de, _rr_side(pe, de, next_side, loads), loads)
        if placement.read_side is not None:
            next_side = ReadSide.DE if next_side is ReadSide.PE else ReadSide.PE
        placements.append(placement)
    new_state = RoundRobinState(pe_cursor % max(len(pes), 1), de_cursor % max(len(des), 1), next_side)
    return PlacementRound(tuple(placements), new_state)


def place(
    policy: str,
    snapshot: ClusterSnapshot,
    thresholds: Thresholds,
    rr_state: RoundRobinState | None = None,
) -> PlacementRound:
    """One scheduling round under `policy` (one of `POLICIES`); `rr_state` is carried between rounds."""
    state = rr_state or RoundRobinState()
    if policy == "dualpath":
        return PlacementRound(place_dualpath(snapshot, thresholds), state)
    if policy == "basic":
        return PlacementRound(place_basic(snapshot, thresholds), state)
    if policy == "dualpath-rr":
        return place_round_robin(snapshot, thresholds, state)
    raise ConfigError(f"unknown placement policy {policy!r}: one of {', '.join(POLICIES)}", param="policy")

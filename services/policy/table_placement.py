"""DualPath's placement policies (PE, DE and read side per request) over a `LoadTable`, at a cost that
follows the requests placed rather than the engines in the cluster.

`tests/reference_placement.py` states the same rules plainly over a `ClusterSnapshot` (the paper's wording,
one engine object at a time); it is the oracle this module is tested against, and this module is what
`round.py` runs for the router and the simulator. What it does differently, none of which changes a
decision (`tests/unit/policy` compares the two on random snapshot sequences):
* whole-cluster questions (which PEs are under beta, has any DE room) are a bisect of sorted loads;
* decode groups and their token totals come from the table, kept up to date as loads change, and only the
  groups that receive a request run the in-group rule;
* a round's working loads are copies of the table's flat lists (C speed), never per-engine objects.
Rows stand for engines; ties still break on engine ids, so row order never matters.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from services.policy.load_table import LoadTable
from services.policy.snapshot import (
    ROLE_DECODE,
    ROLE_PREFILL,
    PendingRequest,
    Placement,
    PlacementRound,
    ReadSide,
    RoundRobinState,
)
from services.policy.thresholds import Thresholds
from shared.errors import ConfigError

POLICIES = ("dualpath", "basic", "dualpath-rr")  # disaggregated: a PE, a DE and a read side per request

# ------------------------------------------------------------------------------------------ PE (5.2)


def select_prefill_rows(
    table: LoadTable,
    requests: Sequence[PendingRequest],
    thresholds: Thresholds,
    *,
    use_read_queue_categories: bool = True,
) -> list[int]:
    """`placement.select_prefill_engines` for `requests` (head first): PE rows of the longest FIFO prefix."""
    beta = thresholds.beta_tokens
    candidates = table.prefill_rows_at_most(beta)
    tokens, num_requests, ids = table.unfinished_tokens, table.num_unfinished, table.engine_ids
    short: list[tuple[int, int, str, int]] = []
    long: list[tuple[int, int, str, int]] = []
    read_queue, is_alive, alpha = table.read_queue_tokens, table.is_storage_alive, thresholds.alpha_tokens
    for row in candidates:
        node = table.nodes[row]
        is_preferred = not use_read_queue_categories or (is_alive[node] and read_queue[node] <= alpha)
        (short if is_preferred else long).append((tokens[row], num_requests[row], ids[row], row))
    heapq.heapify(short)
    heapq.heapify(long)
    chosen: list[int] = []
    for request in requests:
        pool = short or long
        if not pool:
            break
        num_tokens, count, engine_id, row = pool[0]
        chosen.append(row)
        if num_tokens + request.prompt_tokens <= beta:
            heapq.heapreplace(pool, (num_tokens + request.prompt_tokens, count + 1, engine_id, row))
        else:
            heapq.heappop(pool)  # now category 1
    return chosen


# ------------------------------------------------------------------------------------------ DE (5.3)


def select_decode_rows(
    table: LoadTable, requests: Sequence[PendingRequest], z_factor: float
) -> list[int | None]:
    """`placement.select_decode_engines`: group by least total tokens, then the in-group rule."""
    heap = [(total, group) for group, total in table.decode_group_tokens.items()]
    heapq.heapify(heap)
    queues: dict[str, list[PendingRequest]] = {}
    for request in requests:
        if not heap:
            break
        total, group = heap[0]
        heapq.heapreplace(heap, (total + request.prompt_tokens, group))
        queues.setdefault(group, []).append(request)
    placed: dict[str, int] = {}
    for group, private_queue in queues.items():
        placed.update(_place_in_group(table, group, private_queue, z_factor))
    return [placed.get(r.request_id) for r in requests]


def _high_token_threshold(
    table: LoadTable, group: str, private_queue: Sequence[PendingRequest], z_factor: float
) -> float:
    members = table.decode_groups[group]
    hbm_left = sum(table.free_kv_tokens[row] for row in members)
    fitting_tokens = 0
    for request in private_queue:
        if request.hbm_need_tokens > hbm_left:
            break
        hbm_left -= request.hbm_need_tokens
        fitting_tokens += request.prompt_tokens
    return z_factor * (fitting_tokens + table.decode_group_tokens[group]) / len(members)


def _place_in_group(
    table: LoadTable, group: str, private_queue: Sequence[PendingRequest], z_factor: float
) -> dict[str, int]:
    """`placement._place_in_group`: fewest requests among the low set, else fewest tokens, among DEs with
    room; one pass over the group's members per request (members are few, a DE group is one node)."""
    z_tokens = _high_token_threshold(table, group, private_queue, z_factor)
    members = table.decode_groups[group]
    ids = [table.engine_ids[row] for row in members]
    tokens = [table.unfinished_tokens[row] for row in members]
    requests = [table.num_unfinished[row] for row in members]
    free_kv = [table.free_kv_tokens[row] for row in members]
    placed: dict[str, int] = {}
    for request in private_queue:
        need, prompt = request.hbm_need_tokens, request.prompt_tokens
        best_low: tuple[int, int, str, int] | None = None
        best_any: tuple[int, int, str, int] | None = None
        for k in range(len(members)):
            if free_kv[k] < need:
                continue
            if tokens[k] + prompt <= z_tokens:
                key = (requests[k], tokens[k], ids[k], k)
                best_low = key if best_low is None or key < best_low else best_low
            elif best_low is None:
                key = (tokens[k], requests[k], ids[k], k)
                best_any = key if best_any is None or key < best_any else best_any
        best = best_low or best_any
        if best is None:
            break
        k = best[3]
        tokens[k] += prompt
        requests[k] += 1
        free_kv[k] -= need
        placed[request.request_id] = members[k]
    return placed


def _read_side(
    pe_node: int, de_node: int, read_queue: dict[int, int], is_alive: dict[int, bool]
) -> ReadSide | None:
    """`placement.choose_read_side`: the live side with the shorter read queue, the PE's on a tie."""
    if not is_alive[de_node]:
        return ReadSide.PE if is_alive[pe_node] else None
    if not is_alive[pe_node] or read_queue[de_node] < read_queue[pe_node]:
        return ReadSide.DE
    return ReadSide.PE


# ------------------------------------------------------------------------------------------ policies


def _placement(
    table: LoadTable,
    request: PendingRequest,
    pe: int,
    de: int,
    side: ReadSide | None,
    read_queue: dict[int, int],
) -> Placement:
    """The decision, with its read enqueued on the chosen node (later decisions see it)."""
    pe_id, de_id = table.engine_ids[pe], table.engine_ids[de]
    node = None if side is None else table.nodes[pe if side is ReadSide.PE else de]
    if node is None or request.hit_tokens == 0:
        return Placement(request.request_id, pe_id, de_id, None, None, 0)
    read_queue[node] += request.hit_tokens
    return Placement(request.request_id, pe_id, de_id, side, node, request.hit_tokens)


def place_staged(
    table: LoadTable,
    requests: Sequence[PendingRequest],
    pe_rows: Sequence[int],
    thresholds: Thresholds,
    *,
    is_dualpath: bool,
) -> tuple[Placement, ...]:
    """`dualpath` / `basic` given the PE stage's rows for the head of `requests`."""
    head = requests[: len(pe_rows)]
    de_rows = select_decode_rows(table, head, thresholds.z_factor)
    read_queue, is_alive, nodes = dict(table.read_queue_tokens), table.is_storage_alive, table.nodes
    placements: list[Placement] = []
    for request, pe, de in zip(head, pe_rows, de_rows, strict=True):
        if de is None:
            break
        if is_dualpath:
            side = _read_side(nodes[pe], nodes[de], read_queue, is_alive)
        else:
            side = ReadSide.PE if is_alive[nodes[pe]] else None  # Basic: PE SNICs only
        placements.append(_placement(table, request, pe, de, side, read_queue))
    return tuple(placements)


def _next_in_ring(
    table: LoadTable, ring: Sequence[int], cursor: int, is_eligible: Callable[[int], bool]
) -> int | None:
    """Index in `ring` of the first non-draining, eligible row from `cursor` on, cyclically; None if none."""
    for step in range(len(ring)):
        index = (cursor + step) % len(ring)
        if not table.is_draining[ring[index]] and is_eligible(ring[index]):
            return index
    return None


def place_round_robin(
    table: LoadTable, requests: Sequence[PendingRequest], thresholds: Thresholds, state: RoundRobinState
) -> PlacementRound:
    """`placement.place_round_robin` over the table."""
    tokens, free_kv = table.unfinished_tokens.copy(), table.free_kv_tokens.copy()
    read_queue, is_alive, nodes = dict(table.read_queue_tokens), table.is_storage_alive, table.nodes
    pes, des = table.rows_by_id(ROLE_PREFILL), table.rows_by_id(ROLE_DECODE)
    pe_cursor, de_cursor, next_side = state.pe_cursor, state.de_cursor, state.next_side
    beta = thresholds.beta_tokens
    placements: list[Placement] = []
    for request in requests:
        pe_index = _next_in_ring(table, pes, pe_cursor, lambda row: tokens[row] <= beta)
        need = request.hbm_need_tokens
        de_index = _next_in_ring(table, des, de_cursor, lambda row: free_kv[row] >= need)  # noqa: B023
        if pe_index is None or de_index is None:
            break
        pe, de = pes[pe_index], des[de_index]
        tokens[pe] += request.prompt_tokens  # only a PE's tokens and a DE's free KV decide in this policy
        free_kv[de] -= request.hbm_need_tokens
        pe_cursor, de_cursor = pe_index + 1, de_index + 1
        other = ReadSide.DE if next_side is ReadSide.PE else ReadSide.PE
        node_of = {ReadSide.PE: nodes[pe], ReadSide.DE: nodes[de]}
        side = next((s for s in (next_side, other) if is_alive[node_of[s]]), None)
        placement = _placement(table, request, pe, de, side, read_queue)
        if placement.read_side is not None:
            next_side = other
        placements.append(placement)
    new_state = RoundRobinState(pe_cursor % max(len(pes), 1), de_cursor % max(len(des), 1), next_side)
    return PlacementRound(tuple(placements), new_state)


def place_window(
    policy: str,
    table: LoadTable,
    requests: Sequence[PendingRequest],
    thresholds: Thresholds,
    rr_state: RoundRobinState,
    *,
    is_partial: bool,
) -> PlacementRound | None:
    """One round of `policy` over `requests`, the head of a longer queue when `is_partial`; None when a
    longer head could place more (the PE stage, or round-robin, used every request of this one)."""
    if policy == "dualpath-rr":
        result = place_round_robin(table, requests, thresholds, rr_state)
        return None if is_partial and len(result.placements) == len(requests) else result
    if policy not in POLICIES:
        raise ConfigError(
            f"unknown placement policy {policy!r}: one of {', '.join(POLICIES)}", param="policy"
        )
    is_dualpath = policy == "dualpath"
    pe_rows = select_prefill_rows(table, requests, thresholds, use_read_queue_categories=is_dualpath)
    if is_partial and len(pe_rows) >= len(requests):
        return None
    return PlacementRound(
        place_staged(table, requests, pe_rows, thresholds, is_dualpath=is_dualpath), rr_state
    )

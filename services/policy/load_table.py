"""The cluster's loads as one flat, id-indexed table updated in place: what a placement round reads.

A `ClusterSnapshot` is a tuple of immutable engine snapshots; building and indexing one is a Python loop
over every engine, which at paper scale (1,152 engines) was most of a round. A `LoadTable` holds the same
fields as flat lists (engine i's tokens are `unfinished_tokens[i]`) plus the few whole-cluster aggregates a
round asks for (live PEs sorted by tokens, live DEs by free KV, per-group decode totals), and its owner
rewrites only the engines and nodes whose loads changed (`update_engine`, `update_node`). The simulator
keeps one for the whole run; the live router keeps one too (`services/router/load_sync.py`: the services
that reported or were sent work since the last round) and builds a new one (`of`) only when a service left.

Pure data with no I/O. Placement functions read a table and never write it (they copy what they change).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.policy.snapshot import (
    ROLE_DECODE,
    ROLE_PREFILL,
    EngineSnapshot,
    NodeSnapshot,
)
from shared.errors import KvpathError


def _load(entry: tuple[int, int]) -> int:
    return entry[0]


@dataclass(slots=True)
class LoadTable:
    """Engines (row i: `engine_ids[i]`, in the order first seen) and nodes, with their current loads.

    `decode_groups` maps a group to its live (non-draining) DE rows and `decode_group_tokens` to their total
    unfinished tokens; both only list groups with at least one live DE. Rows are never removed: an engine
    that leaves is updated as draining (the live router builds a new table when one leaves instead).
    """

    engine_ids: list[str] = field(default_factory=list)
    row_of: dict[str, int] = field(default_factory=dict)
    roles: list[str] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    num_unfinished: list[int] = field(default_factory=list)
    unfinished_tokens: list[int] = field(default_factory=list)
    free_kv_tokens: list[int] = field(default_factory=list)
    is_draining: list[bool] = field(default_factory=list)
    read_queue_tokens: dict[int, int] = field(default_factory=dict)
    is_storage_alive: dict[int, bool] = field(default_factory=dict)
    decode_groups: dict[str, list[int]] = field(default_factory=dict)
    decode_group_tokens: dict[str, int] = field(default_factory=dict)
    # (unfinished tokens, row) of the live PEs and (free KV, row) of the live DEs, sorted: a round's
    # "is any PE under beta", "which are" and "has any DE room" are a bisect, not a scan of every engine
    _prefill_by_tokens: list[tuple[int, int]] = field(default_factory=list)
    _decode_by_free_kv: list[tuple[int, int]] = field(default_factory=list)
    _sorted_rows: dict[str, list[int]] = field(default_factory=dict)  # per role, by engine id (round-robin)

    @classmethod
    def of(cls, engines: Iterable[EngineSnapshot], nodes: Iterable[NodeSnapshot]) -> LoadTable:
        """A table holding `engines` and `nodes` (what `ClusterSnapshot` checks is checked here too)."""
        table = cls()
        for n in nodes:
            if n.node in table.read_queue_tokens:
                raise KvpathError("inconsistent scheduling snapshot: duplicate node ids")
            table.update_node(n)
        for e in engines:
            if e.engine_id in table.row_of:
                raise KvpathError("inconsistent scheduling snapshot: duplicate engine ids")
            table.update_engine(e)
        return table

    # ---------------------------------------------------------------------------------------- updates

    def update_node(self, node: NodeSnapshot) -> None:
        self.read_queue_tokens[node.node] = node.read_queue_tokens
        self.is_storage_alive[node.node] = node.is_storage_alive

    def update_engine(self, engine: EngineSnapshot) -> None:
        """Set one engine's row to `engine` (adding the row on first sight)."""
        if engine.node not in self.read_queue_tokens:
            missing = [engine.node]
            raise KvpathError(
                f"inconsistent scheduling snapshot: engines on nodes without a node snapshot: {missing}"
            )
        row = self.row_of.get(engine.engine_id)
        if row is None:
            row = self._add_row(engine)
        elif (engine.role, engine.node, engine.group, engine.is_draining) == (
            self.roles[row],
            self.nodes[row],
            self.groups[row],
            self.is_draining[row],
        ):
            self.update_loads(
                engine.engine_id, engine.num_unfinished, engine.unfinished_tokens, engine.free_kv_tokens
            )
            return
        self._unsort(row)
        self._leave_decode_group(row)
        self._sorted_rows.clear()
        self.roles[row], self.nodes[row], self.groups[row] = engine.role, engine.node, engine.group
        self.num_unfinished[row] = engine.num_unfinished
        self.unfinished_tokens[row] = engine.unfinished_tokens
        self.free_kv_tokens[row] = engine.free_kv_tokens
        self.is_draining[row] = engine.is_draining
        self._join_decode_group(row)
        self._sort(row)

    def update_loads(
        self, engine_id: str, num_unfinished: int, unfinished_tokens: int, free_kv_tokens: int
    ) -> None:
        """`update_engine` for an engine in the table whose role, node, group and draining flag stay: only
        its three loads change (what a placement, a finished prefill or a finished decode changes)."""
        if min(num_unfinished, unfinished_tokens, free_kv_tokens) < 0:
            raise KvpathError(
                f"inconsistent scheduling snapshot: engine {engine_id} has a negative load field"
            )
        row = self.row_of[engine_id]
        self._unsort(row)
        if self.roles[row] == ROLE_DECODE and not self.is_draining[row]:
            self.decode_group_tokens[self.groups[row]] += unfinished_tokens - self.unfinished_tokens[row]
        self.num_unfinished[row] = num_unfinished
        self.unfinished_tokens[row] = unfinished_tokens
        self.free_kv_tokens[row] = free_kv_tokens
        self._sort(row)

    def _sorted_entry(self, row: int) -> tuple[list[tuple[int, int]] | None, tuple[int, int]]:
        """The sorted list a row belongs in (None: neither a live PE nor a live DE) and its entry there."""
        if self.is_draining[row]:
            return None, (0, row)
        if self.roles[row] == ROLE_PREFILL:
            return self._prefill_by_tokens, (self.unfinished_tokens[row], row)
        if self.roles[row] == ROLE_DECODE:
            return self._decode_by_free_kv, (self.free_kv_tokens[row], row)
        return None, (0, row)

    def _unsort(self, row: int) -> None:
        entries, entry = self._sorted_entry(row)
        if entries is not None:
            index = bisect_left(entries, entry)
            assert entries[index] == entry, "a live row is in its sorted list"
            del entries[index]

    def _sort(self, row: int) -> None:
        entries, entry = self._sorted_entry(row)
        if entries is not None:
            insort(entries, entry)

    def _add_row(self, engine: EngineSnapshot) -> int:
        row = len(self.engine_ids)
        self.engine_ids.append(engine.engine_id)
        self.row_of[engine.engine_id] = row
        self.roles.append("")  # no role yet: the caller sets the row, which then joins its decode group
        self.groups.append("")
        self.is_draining.append(True)  # in no sorted list or decode group until the caller sets the row
        for column in (self.nodes, self.num_unfinished, self.unfinished_tokens, self.free_kv_tokens):
            column.append(0)
        self._sorted_rows.clear()
        return row

    def _leave_decode_group(self, row: int) -> None:
        if self.roles[row] != ROLE_DECODE or self.is_draining[row]:
            return
        group = self.groups[row]
        members = self.decode_groups[group]
        members.remove(row)
        if members:
            self.decode_group_tokens[group] -= self.unfinished_tokens[row]
        else:
            del self.decode_groups[group], self.decode_group_tokens[group]

    def _join_decode_group(self, row: int) -> None:
        if self.roles[row] != ROLE_DECODE or self.is_draining[row]:
            return
        group = self.groups[row]
        self.decode_groups.setdefault(group, []).append(row)
        self.decode_group_tokens[group] = self.decode_group_tokens.get(group, 0) + self.unfinished_tokens[row]

    # ---------------------------------------------------------------------------------------- queries

    def has_live(self, role: str) -> bool:
        """Whether a non-draining engine of `role` (prefill or decode) is in the table."""
        return bool(self._prefill_by_tokens if role == ROLE_PREFILL else self._decode_by_free_kv)

    def prefill_rows_at_most(self, max_tokens: float) -> list[int]:
        """Rows of the live PEs with at most `max_tokens` unfinished tokens, fewest tokens first."""
        entries = self._prefill_by_tokens
        return [row for _, row in entries[: bisect_right(entries, max_tokens, key=_load)]]

    def has_prefill_at_most(self, max_tokens: float) -> bool:
        entries = self._prefill_by_tokens
        return bool(entries) and entries[0][0] <= max_tokens

    def has_decode_room(self, kv_tokens: int) -> bool:
        """Whether a live DE has at least `kv_tokens` of free KV."""
        entries = self._decode_by_free_kv
        return bool(entries) and entries[-1][0] >= kv_tokens

    def rows_by_id(self, role: str) -> list[int]:
        """Rows of `role` (draining ones included) ordered by engine id: the round-robin ring."""
        rows = self._sorted_rows.get(role)
        if rows is None:
            rows = sorted((r for r, x in enumerate(self.roles) if x == role), key=self.engine_ids.__getitem__)
            self._sorted_rows[role] = rows
        return rows

    def engine(self, row: int) -> EngineSnapshot:
        return EngineSnapshot(
            self.engine_ids[row],
            self.roles[row],
            self.nodes[row],
            self.groups[row],
            self.num_unfinished[row],
            self.unfinished_tokens[row],
            self.free_kv_tokens[row],
            self.is_draining[row],
        )

    def engines(self) -> tuple[EngineSnapshot, ...]:
        return tuple(self.engine(row) for row in range(len(self.engine_ids)))

    def node_snapshots(self) -> tuple[NodeSnapshot, ...]:
        alive = self.is_storage_alive
        return tuple(NodeSnapshot(n, q, alive[n]) for n, q in self.read_queue_tokens.items())

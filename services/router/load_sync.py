"""The router's `LoadTable`, kept in step with its `EngineTable` instead of rebuilt for every placement round.

At paper scale (1,152 engines) a round spent ~5 ms turning every engine's last report into a snapshot and the
snapshots into a table, while between two rounds only the services that reported or were sent work change.
`EngineTable` notes those (`take_changed`) and whether a service left (`has_left`: removed, refused, or its
role or node changed); `TableSync.sync` rewrites only the changed rows, adds the engines and nodes that
joined, and rebuilds the table when a service left, one of its members may have gone silent, or the block
size changed (all rare). The table equals `LoadTable.of(*engines.cluster_snapshot(block_size))` with its rows
in another order, which no decision depends on (ties are broken by engine id); the members' measured rates
(the thresholds' inputs) are kept alongside. `tests/unit/router/test_load_sync.py` checks both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.policy.load_table import LoadTable
from services.policy.snapshot import ENGINE_ROLES, ROLE_PREFILL, EngineSnapshot, NodeSnapshot
from shared.protocol import LoadReport

ROLE_STORAGE = "storage"


class ServiceState(Protocol):
    """One service as `engines.EngineState` holds it: its last report and what the router sent since."""

    @property
    def report(self) -> LoadReport: ...

    @property
    def received_at(self) -> float: ...

    @property
    def is_suspect(self) -> bool: ...

    def snapshot(self, block_size: int) -> EngineSnapshot: ...


class Services(Protocol):
    """What `TableSync` reads of `engines.EngineTable`, its owner (a protocol: imports go one way)."""

    silence_timeout_s: float
    has_left: bool

    def take_changed(self) -> Sequence[ServiceState]: ...

    def live(self, now: float) -> Sequence[ServiceState]: ...

    def node_snapshot(self, node: int, now: float) -> NodeSnapshot: ...

    def cluster_snapshot(
        self, block_size: int, now: float | None = None
    ) -> tuple[tuple[EngineSnapshot, ...], tuple[NodeSnapshot, ...]]: ...


@dataclass(slots=True)
class TableSync:
    """Owned by one `EngineTable`; `sync` is called once per placement round, never by anything else."""

    table: LoadTable | None = None
    block_size: int = 0
    # at most the oldest last-report time among the members: past the silence timeout, one may be silent
    oldest_report_s: float = math.inf
    prefill_rates: dict[str, float] = field(default_factory=dict)  # live PEs' prefill_tokens_per_s
    read_rates: dict[str, float] = field(default_factory=dict)  # live storage's read_bandwidth_bytes_per_s

    def sync(self, engines: Services, block_size: int, now: float | None = None) -> LoadTable:
        """The live engines and nodes as `engines.cluster_snapshot(block_size)` would give them, now."""
        now = time.monotonic() if now is None else now
        is_stale = self.oldest_report_s < now - engines.silence_timeout_s
        if self.table is None or engines.has_left or block_size != self.block_size or is_stale:
            return self._rebuild(engines, block_size, now)
        try:
            for state in engines.take_changed():
                if now - state.received_at <= engines.silence_timeout_s and not state.is_suspect:
                    self._update(self.table, engines, state, now)
        except Exception:
            self.table = None  # half updated: the next round rebuilds it
            raise
        return self.table

    def _update(self, table: LoadTable, engines: Services, state: ServiceState, now: float) -> None:
        report = state.report
        if report.role == ROLE_STORAGE:
            self.read_rates[report.service_id] = report.rates.get("read_bandwidth_bytes_per_s", 0.0)
            table.update_node(engines.node_snapshot(report.node, now))
        elif report.role in ENGINE_ROLES:
            if report.node not in table.read_queue_tokens:
                table.update_node(engines.node_snapshot(report.node, now))  # an engine on a new node
            table.update_engine(state.snapshot(self.block_size))
            if report.role == ROLE_PREFILL:
                self.prefill_rates[report.service_id] = report.rates.get("prefill_tokens_per_s", 0.0)

    def _rebuild(self, engines: Services, block_size: int, now: float) -> LoadTable:
        engines.take_changed()  # all of it is in the new table
        engines.has_left = False
        self.table = None
        members = engines.live(now)
        snapshots, nodes = engines.cluster_snapshot(block_size, now)
        self.table = LoadTable.of(snapshots, nodes)
        self.block_size = block_size
        self.oldest_report_s = min((st.received_at for st in members), default=math.inf)
        self.prefill_rates.clear()
        self.read_rates.clear()
        for state in members:
            rates, service_id = state.report.rates, state.report.service_id
            if state.report.role == ROLE_PREFILL:
                self.prefill_rates[service_id] = rates.get("prefill_tokens_per_s", 0.0)
            elif state.report.role == ROLE_STORAGE:
                self.read_rates[service_id] = rates.get("read_bandwidth_bytes_per_s", 0.0)
        return self.table

    def note_report_time(self, received_at: float) -> None:
        """A service reported at `received_at` (the router's clock; callers may pass an earlier one)."""
        self.oldest_report_s = min(self.oldest_report_s, received_at)

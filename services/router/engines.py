"""The router's view of live engines, built from their load reports (pure bookkeeping, no I/O).

It is also where the policies' snapshots come from: `cluster_snapshot` turns the latest reports, plus the work
the router sent since, into the `EngineSnapshot`s / `NodeSnapshot`s every policy reads (one builder for the
colocated and the disaggregated dispatch).

KV format: every engine announces the format of its KV (fingerprint, block size, bytes per token) in its
load reports. The table adopts the format of the first engine it hears from and refuses engines that
announce another one (they never appear in a snapshot, so no request reaches them; `refused` says why);
when no live engine holds the adopted format any more, the next engine's format is adopted. The router
hashes prompts with the adopted format, so its hashes and the engines' always agree.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.policy.snapshot import ENGINE_ROLES, EngineSnapshot, NodeSnapshot
from shared.protocol import KvFormat, LoadReport

log = logging.getLogger(__name__)

ROLE_STORAGE = "storage"


@dataclass(slots=True)
class EngineState:
    report: LoadReport
    received_at: float  # router's monotonic clock
    # work the router sent since that report, so back-to-back decisions see it before the next report
    pending_requests: int = 0
    pending_tokens: int = 0
    pending_kv_tokens: int = 0

    def snapshot(self, block_size: int) -> EngineSnapshot:
        r = self.report
        return EngineSnapshot(
            engine_id=r.service_id,
            role=r.role,
            node=r.node,
            group=f"node{r.node}",
            num_unfinished=r.num_running + r.num_waiting + self.pending_requests,
            unfinished_tokens=r.unfinished_tokens + self.pending_tokens,
            free_kv_tokens=max(0, r.free_kv_blocks * block_size - self.pending_kv_tokens),
            is_draining=r.is_draining,
        )


class EngineTable:
    """Latest load report per service, keyed by service id; storage services are tracked too."""

    def __init__(self, silence_timeout_s: float) -> None:
        self.silence_timeout_s = silence_timeout_s
        self._engines: dict[str, EngineState] = {}
        self.kv_format: KvFormat | None = None  # adopted from the engines; None until one reports
        self.refused: dict[str, str] = {}  # engine id -> why its reports are ignored

    def update(self, report: LoadReport, now: float) -> None:
        current = self._engines.get(report.service_id)
        if current is not None and report.seq <= current.report.seq and not report.seq == 1:
            return  # stale or reordered report (seq 1 = the service restarted)
        if report.role in ENGINE_ROLES and not self._accepts_format(report, now):
            self._engines.pop(report.service_id, None)
            return
        self.refused.pop(report.service_id, None)
        self._engines[report.service_id] = EngineState(report=report, received_at=now)

    def _accepts_format(self, report: LoadReport, now: float) -> bool:
        """Whether the engine's KV format is the adopted one (adopting it when no live engine holds one)."""
        announced = report.kv_format
        if announced is not None and announced == self.kv_format:
            return True
        if announced is None:
            reason = "announces no KV format"
        elif self.kv_format is None or not self._has_live_format(now):
            if self.kv_format is not None:
                log.warning("KV format changed: no live engine holds the old one; adopting %s", announced)
            self.kv_format = announced
            return True
        else:
            reason = (
                f"KV format {announced.fingerprint!r} (block_size={announced.block_size}) differs from the "
                f"adopted {self.kv_format.fingerprint!r} (block_size={self.kv_format.block_size})"
            )
        if self.refused.get(report.service_id) != reason:
            log.error("engine refused engine=%s: %s", report.service_id, reason)
        self.refused[report.service_id] = reason
        return False

    def _has_live_format(self, now: float) -> bool:
        return any(st.report.kv_format == self.kv_format for st in self.live(now, roles=ENGINE_ROLES))

    def note_assigned(self, service_id: str, tokens: int, *, kv_tokens: int = 0) -> None:
        state = self._engines.get(service_id)
        if state is not None:
            state.pending_requests += 1
            state.pending_tokens += tokens
            state.pending_kv_tokens += kv_tokens

    def note_unassigned(self, service_id: str, tokens: int) -> None:
        """Undo `note_assigned` for a task the engine did not take (unless a report already reset it)."""
        state = self._engines.get(service_id)
        if state is not None:
            state.pending_requests = max(0, state.pending_requests - 1)
            state.pending_tokens = max(0, state.pending_tokens - tokens)

    def storage_of(self, node: int) -> str | None:
        """The service id of node `node`'s storage service, if it reports."""
        for sid, st in self._engines.items():
            if st.report.role == ROLE_STORAGE and st.report.node == node:
                return sid
        return None

    def remove(self, service_id: str) -> None:
        self._engines.pop(service_id, None)

    def live(self, now: float, *, roles: tuple[str, ...] | None = None) -> list[EngineState]:
        out = []
        for state in self._engines.values():
            if now - state.received_at > self.silence_timeout_s:
                continue
            if roles is not None and state.report.role not in roles:
                continue
            out.append(state)
        return out

    def silent(self, now: float) -> list[str]:
        """Services whose reports stopped: they are dead or cut off."""
        return [sid for sid, st in self._engines.items() if now - st.received_at > self.silence_timeout_s]

    def get(self, service_id: str) -> EngineState | None:
        return self._engines.get(service_id)

    # ------------------------------------------------------------------------------------- snapshots

    def engine_snapshots(
        self, block_size: int, roles: tuple[str, ...] = ENGINE_ROLES
    ) -> tuple[EngineSnapshot, ...]:
        """Every live engine of `roles` as the policies see it."""
        return tuple(st.snapshot(block_size) for st in self.live(time.monotonic(), roles=roles))

    def cluster_snapshot(
        self, block_size: int
    ) -> tuple[tuple[EngineSnapshot, ...], tuple[NodeSnapshot, ...]]:
        """Live engines and every node that has an engine or a storage service: its read queue (reported
        plus sent since) and whether its storage answers."""
        engines = self.engine_snapshots(block_size)
        storage = {st.report.node: st for st in self.live(time.monotonic(), roles=(ROLE_STORAGE,))}
        nodes = []
        for node in sorted({e.node for e in engines} | storage.keys()):
            reader = storage.get(node)
            queued = reader.report.read_queue_tokens + reader.pending_tokens if reader is not None else 0
            is_alive = reader is not None and not reader.report.is_draining
            nodes.append(NodeSnapshot(node=node, read_queue_tokens=queued, is_storage_alive=is_alive))
        return engines, tuple(nodes)

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

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from services.policy.load_table import LoadTable
from services.policy.snapshot import ENGINE_ROLES, EngineSnapshot, NodeSnapshot
from services.router.load_sync import ROLE_STORAGE, TableSync
from shared.protocol import KvFormat, LoadReport

log = logging.getLogger(__name__)

__all__ = ["ROLE_STORAGE", "EngineState", "EngineTable"]


@dataclass(slots=True)
class EngineState:
    report: LoadReport
    received_at: float  # router's monotonic clock
    # work the router sent since that report, so back-to-back decisions see it before the next report
    pending_requests: int = 0
    pending_tokens: int = 0
    pending_kv_tokens: int = 0
    # when that KV comes back, where the router priced it: (its monotonic clock, tokens)
    pending_kv_release: list[tuple[float, int]] = field(default_factory=list)
    # another engine saw this one go (its KV data plane broke): out of every decision until a report numbered
    # past `suspect_until_seq` (one it sent before it went may still be on its way) or a restart's
    is_suspect: bool = False
    suspect_until_seq: int = 0

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
    """Latest load report per service, keyed by service id; storage services are tracked too.

    A service's state changes only through these methods (reports and notes), which record it for the
    placement rounds' `load_table`."""

    def __init__(self, silence_timeout_s: float, *, return_wait_s: float = 0.0) -> None:
        self.silence_timeout_s = silence_timeout_s
        self.return_wait_s = return_wait_s  # how long a lost engine may take to come back (`return_window`)
        self._return_waiters: list[asyncio.Future[None]] = []  # `engine_returned`
        self._engines: dict[str, EngineState] = {}
        self._storage_at: dict[int, dict[str, None]] = {}  # node -> its storage services, in `_engines` order
        self.kv_format: KvFormat | None = None  # adopted from the engines; None until one reports
        self.refused: dict[str, str] = {}  # engine id -> why its reports are ignored
        self._changed: dict[str, None] = {}  # services changed since `load_table` last looked (in order)
        self.has_left = False  # a service left or moved since then: `load_table` rebuilds
        self._sync = TableSync()
        self._report_waiters: dict[str, list[asyncio.Future[None]]] = {}  # `next_report`
        self.bus_down_since: float | None = None  # `bus_down`: the router's bus carries nothing since then

    def bus_down(self, now: float) -> None:
        """The router's bus stopped carrying messages (disconnected, or its server does not answer a ping):
        until `bus_up`, an engine's silence is the bus's, not the engine's (`silent` names none)."""
        if self.bus_down_since is None:
            self.bus_down_since = now
            log.warning("bus down: engines' silence is not counted until it is back")

    def bus_up(self, now: float) -> None:
        """The bus carries messages again: every engine counts as heard now (their reports of the outage were
        lost or are still on their way), so one that died meanwhile is silent a full timeout later."""
        if self.bus_down_since is None:
            return
        log.warning("bus back after %.1f s: engines' silence counts again", now - self.bus_down_since)
        self.bus_down_since = None
        for state in self._engines.values():
            state.received_at = max(state.received_at, now)
        self.has_left = True  # the placement table rebuilds with every engine back in it

    async def next_report(self, service_id: str, timeout_s: float) -> bool:
        """Whether the service reports its load within `timeout_s` from now (it is alive and connected)."""
        waiter = asyncio.get_running_loop().create_future()
        self._report_waiters.setdefault(service_id, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, max(0.0, timeout_s))
        except TimeoutError:
            return False
        finally:
            waiters = self._report_waiters.get(service_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._report_waiters.pop(service_id, None)
        return True

    def update(self, report: LoadReport, now: float) -> None:
        current = self._engines.get(report.service_id)
        if current is not None and report.seq <= current.report.seq and not report.seq == 1:
            return  # stale or reordered report (seq 1 = the service restarted)
        if report.role in ENGINE_ROLES and not self._accepts_format(report, now):
            self._forget(report.service_id)
            return
        self.refused.pop(report.service_id, None)
        if current is not None and (current.report.role, current.report.node) != (report.role, report.node):
            self._forget(report.service_id)  # moved: it leaves its old node, then joins as new
        state = EngineState(report=report, received_at=now)
        if report.role in ENGINE_ROLES and (
            current is None or report.seq == 1 or not self._is_live(current, now)
        ):
            self._wake_returns()  # a new engine, a restarted one, or one back from silence or suspicion
        if current is not None and current.is_suspect:
            if report.seq != 1 and report.seq <= current.suspect_until_seq:
                state.is_suspect, state.suspect_until_seq = True, current.suspect_until_seq
            else:
                self.has_left = True  # it is back: the placement table rebuilds with it
        if report.service_id not in self._engines and report.role == ROLE_STORAGE:
            self._storage_at.setdefault(report.node, {})[report.service_id] = None
        self._engines[report.service_id] = state
        self._changed[report.service_id] = None
        self._sync.note_report_time(now)
        for waiter in self._report_waiters.pop(report.service_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    def _forget(self, service_id: str) -> None:
        state = self._engines.pop(service_id, None)
        if state is None:
            return
        self.has_left = True
        self._changed.pop(service_id, None)
        at_node = self._storage_at.get(state.report.node, {})
        at_node.pop(service_id, None)
        if not at_node:
            self._storage_at.pop(state.report.node, None)

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
            self._changed[service_id] = None

    def note_kv_reserved(self, service_id: str, kv_tokens: int, release_in_s: float = math.inf) -> None:
        """KV the router expects a request it sent to keep resident, until the engine's next report, and in
        how many seconds it comes back (inf: not known)."""
        state = self._engines.get(service_id)
        if state is not None:
            state.pending_kv_tokens += kv_tokens
            if math.isfinite(release_in_s):
                state.pending_kv_release.append((time.monotonic() + release_in_s, kv_tokens))
            self._changed[service_id] = None

    def note_refused(self, de_id: str, pe_id: str, tokens: int) -> None:
        """A decode engine refused a request for want of room: it counts as full until its next report
        (which replaces this state), and the prefill engine placed with it did not get the request."""
        state = self._engines.get(de_id)
        if state is not None:
            block_size = self.kv_format.block_size if self.kv_format is not None else 1
            state.pending_kv_tokens = max(state.pending_kv_tokens, state.report.free_kv_blocks * block_size)
            self._changed[de_id] = None
        self.note_unassigned(pe_id, tokens)

    def note_unassigned(self, service_id: str, tokens: int) -> None:
        """Undo `note_assigned` for a task the engine did not take (unless a report already reset it)."""
        state = self._engines.get(service_id)
        if state is not None:
            state.pending_requests = max(0, state.pending_requests - 1)
            state.pending_tokens = max(0, state.pending_tokens - tokens)
            self._changed[service_id] = None

    def suspect(self, service_id: str) -> bool:
        """Another engine lost its connection to this one: leave it out of the live engines (so no decision
        picks it) until it reports again, past the report that may have been on its way (seq + 1). A dead
        engine stays out, and the silence timeout then fails its streams; a live one is back within two
        report intervals. Its streams are not failed here. True when it was live and is now left out."""
        state = self._engines.get(service_id)
        if state is None or state.is_suspect:
            return False
        state.is_suspect, state.suspect_until_seq = True, state.report.seq + 1
        self.has_left = True  # the placement table rebuilds without it
        return True

    def storage_of(self, node: int) -> str | None:
        """The service id of node `node`'s storage service, if it reports."""
        return next(iter(self._storage_at.get(node, ())), None)

    def remove(self, service_id: str) -> None:
        self._forget(service_id)

    def take_changed(self) -> list[EngineState]:
        """The services changed since the last call (reports, notes), and forget them."""
        changed, self._changed = self._changed, {}
        return [self._engines[sid] for sid in changed]

    def _is_live(self, state: EngineState, now: float) -> bool:
        return now - state.received_at <= self.silence_timeout_s and not state.is_suspect

    def return_window(self, now: float) -> float:
        """Seconds a request that finds no engine may still wait for one to come back: `return_wait_s`
        after the last report of an engine that is out now (silent, or suspect after a send found it gone:
        dead, or restarting); 0 when none is."""
        out = [
            s for s in self._engines.values() if s.report.role in ENGINE_ROLES and not self._is_live(s, now)
        ]
        heard = max((s.received_at for s in out), default=-math.inf)
        return max(0.0, heard + self.return_wait_s - now)

    async def engine_returned(self, timeout_s: float) -> bool:
        """Whether an engine reports within `timeout_s` that was not live (new, restarted, back)."""
        waiter = asyncio.get_running_loop().create_future()
        self._return_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, max(0.0, timeout_s))
        except TimeoutError:
            return False
        finally:
            if waiter in self._return_waiters:
                self._return_waiters.remove(waiter)
        return True

    def _wake_returns(self) -> None:
        waiters, self._return_waiters = self._return_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def live(self, now: float, *, roles: tuple[str, ...] | None = None) -> list[EngineState]:
        out = []
        for state in self._engines.values():
            if not self._is_live(state, now):
                continue
            if roles is not None and state.report.role not in roles:
                continue
            out.append(state)
        return out

    def largest_kv_blocks(self, role: str, now: float) -> int:
        """The most KV blocks one live engine of `role` has in all (0: none reports): a request that needs
        more can still run there, ending `length` at the edge of that cache, but never waits for more room."""
        return max((st.report.total_kv_blocks for st in self.live(now, roles=(role,))), default=0)

    def silent(self, now: float) -> list[str]:
        """Services whose reports stopped while the bus worked: they are dead or cut off."""
        if self.bus_down_since is not None:
            return []
        return [sid for sid, st in self._engines.items() if now - st.received_at > self.silence_timeout_s]

    def get(self, service_id: str) -> EngineState | None:
        return self._engines.get(service_id)

    # ------------------------------------------------------------------------------------- snapshots

    def engine_snapshots(
        self, block_size: int, roles: tuple[str, ...] = ENGINE_ROLES, now: float | None = None
    ) -> tuple[EngineSnapshot, ...]:
        """Every live engine of `roles` as the policies see it."""
        now = time.monotonic() if now is None else now
        return tuple(st.snapshot(block_size) for st in self.live(now, roles=roles))

    def load_table(self, block_size: int, now: float | None = None) -> LoadTable:
        """`cluster_snapshot(block_size, now)` as a `LoadTable`, updated in place for what changed since the
        last call (`load_sync.py`); the caller reads it and never writes it."""
        return self._sync.sync(self, block_size, now)

    def rates(self) -> tuple[list[float], list[float]]:
        """(read bandwidths of the live storage services, prefill rates of the live PEs), as of the last
        `load_table`."""
        return list(self._sync.read_rates.values()), list(self._sync.prefill_rates.values())

    def node_snapshot(self, node: int, now: float) -> NodeSnapshot:
        """One node as `cluster_snapshot` gives it (its last live storage service's read queue)."""
        reader = None
        for sid in self._storage_at.get(node, ()):
            state = self._engines[sid]
            if now - state.received_at <= self.silence_timeout_s:
                reader = state
        queued = reader.report.read_queue_tokens + reader.pending_tokens if reader is not None else 0
        is_alive = reader is not None and not reader.report.is_draining
        return NodeSnapshot(node=node, read_queue_tokens=queued, is_storage_alive=is_alive)

    def cluster_snapshot(
        self, block_size: int, now: float | None = None
    ) -> tuple[tuple[EngineSnapshot, ...], tuple[NodeSnapshot, ...]]:
        """Live engines and every node that has an engine or a storage service: its read queue (reported
        plus sent since) and whether its storage answers."""
        now = time.monotonic() if now is None else now
        engines = self.engine_snapshots(block_size, now=now)
        storage = {st.report.node: st for st in self.live(now, roles=(ROLE_STORAGE,))}
        nodes = []
        for node in sorted({e.node for e in engines} | storage.keys()):
            reader = storage.get(node)
            queued = reader.report.read_queue_tokens + reader.pending_tokens if reader is not None else 0
            is_alive = reader is not None and not reader.report.is_draining
            nodes.append(NodeSnapshot(node=node, read_queue_tokens=queued, is_storage_alive=is_alive))
        return engines, tuple(nodes)

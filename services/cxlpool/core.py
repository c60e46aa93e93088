"""The pool service's core: one handler for every operation, whichever transport carried it.

`handle(owner, op, payload)` decodes a request (`shared/cxl/pool_ops.py`), applies it to the block table and
encodes the reply. Both transports call it: the CXL-RPC server thread for clients that share the pool's host,
the asyncio loop for NATS requests; a lock serializes them (the table itself is single-threaded code). It does
no I/O: blocks committed and evicted are queued as `TierChange`s that the service announces as KV events
(location `cxl:<pool>`), so the index knows which prefixes the pool holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import orjson

from services.cxlpool.block_table import BlockTable
from shared.cxl import pool_ops as ops
from shared.cxl.pool_ops import Op, PoolRequestError, PoolStatus
from shared.protocol import encode
from shared.protocol.kv import PoolInfo

log = logging.getLogger(__name__)

MS = 1_000_000
MAX_LEASE_MS = 600_000


@dataclass(frozen=True, slots=True)
class TierChange:
    """Blocks that became readable from the pool (`stored`) or left it (`removed`)."""

    stored: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


class PoolCore:
    def __init__(
        self,
        table: BlockTable,
        info: PoolInfo,
        *,
        default_lease_ms: int,
        on_change: Callable[[], None] = lambda: None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.table = table
        self.info = info
        self.default_lease_ms = default_lease_ms
        self.on_change = on_change  # called (from any thread) when `changes` has something new
        self.clock_ns = clock_ns
        self.lock = threading.Lock()
        self.changes: list[TierChange] = []
        self._info_bytes = encode(info)
        self._handlers: dict[int, Callable[[str, memoryview], bytes]] = {
            Op.INFO: lambda owner, p: self._info_bytes,
            Op.LOOKUP: self._lookup,
            Op.ALLOC: self._alloc,
            Op.COMMIT: self._commit,
            Op.UNPIN: self._unpin,
            Op.FREE: self._free,
            Op.STATS: lambda owner, p: orjson.dumps(self.stats()),
        }

    def handle(self, owner: str, op: int, payload: memoryview | bytes) -> tuple[int, bytes]:
        """(status, reply) for one request; a bad request is answered, never raised."""
        handler = self._handlers.get(op)
        if handler is None:
            return PoolStatus.UNKNOWN_OP, f"unknown pool operation {op}".encode()
        try:
            with self.lock:
                return PoolStatus.OK, handler(owner, memoryview(payload))
        except PoolRequestError as exc:
            return PoolStatus.BAD_REQUEST, exc.message.encode()

    def release_owner(self, owner: str) -> None:
        """A client died: its read leases end and its unfinished writes are given back."""
        with self.lock:
            leases, allocations = self.table.release_owner(owner)
        if leases or allocations:
            log.warning("pool client gone owner=%s leases=%d allocations=%d", owner, leases, allocations)

    def expire(self) -> None:
        with self.lock:
            self.table.expire(self.clock_ns())

    def take_changes(self) -> list[TierChange]:
        with self.lock:
            out, self.changes = self.changes, []
        return out

    def stats(self) -> dict[str, object]:
        return {"pool_id": self.info.pool_id, **asdict(self.table.snapshot_stats())}

    # --------------------------------------------------------------------------------------- ops

    def _lease_ns(self, lease_ms: int) -> int:
        if lease_ms > MAX_LEASE_MS:
            raise PoolRequestError(f"lease of {lease_ms} ms: at most {MAX_LEASE_MS}")
        return (lease_ms or self.default_lease_ms) * MS

    def _lookup(self, owner: str, payload: memoryview) -> bytes:
        req = ops.decode_lookup(payload)
        lease_ns = self._lease_ns(req.lease_ms)
        hit = self.table.lookup(req.hashes, owner, pin=req.pin, lease_ns=lease_ns, now_ns=self.clock_ns())
        return ops.encode_lookup_reply(hit.lease_id, hit.slots, hit.checksums, hit.generations)

    def _alloc(self, owner: str, payload: memoryview) -> bytes:
        hashes, parents, lease_ms = ops.decode_alloc(payload)
        lease_ns = self._lease_ns(lease_ms)
        slots, evicted = self.table.alloc(hashes, parents, owner, lease_ns=lease_ns, now_ns=self.clock_ns())
        if evicted:
            self._changed(TierChange(removed=tuple(evicted)))
        return ops.encode_slots(slots)

    def _commit(self, owner: str, payload: memoryview) -> bytes:
        hashes, checksums = ops.decode_commit(payload)
        generations = self.table.commit_generations(hashes, checksums, owner)
        committed = [h for h, g in zip(hashes, generations, strict=True) if g]
        if committed:
            parents = tuple(self.table.entries[h].parent for h in committed)
            self._changed(TierChange(stored=tuple(committed), parents=parents))
        return ops.encode_generations(generations)

    def _unpin(self, owner: str, payload: memoryview) -> bytes:
        return bytes([self.table.unpin(ops.decode_lease(payload), owner)])

    def _free(self, owner: str, payload: memoryview) -> bytes:
        return ops.encode_count(self.table.free(ops.decode_hashes(payload), owner))

    def _changed(self, change: TierChange) -> None:
        self.changes.append(change)
        self.on_change()

"""A KV pool as its clients (engines, benchmarks) use it: typed operations over either transport, and the
pool's memory mapped for zero-copy slot views.

`PoolClient.connect(bus, pool_id)` asks the pool for its `PoolInfo` over NATS, then attaches the CXL-RPC
segment and maps the devices when this process can (same host, or devices it can open): operations then go
through shared memory (µs), else over NATS (slower, same semantics) and without the memory (`memory` None:
the client can ask, but not read or write blocks). Every call has a deadline; transport failures raise
`ServiceUnavailableError` / `DeadlineExceededError` so callers fall back to another tier.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Protocol

from shared.bus import Bus
from shared.cxl import pool_ops as ops
from shared.cxl.pool_memory import PoolGeometry, PoolMemory
from shared.cxl.pool_ops import LookupReply, Op, PoolStatus
from shared.errors import InvalidRequestError, KvpathError, ServiceUnavailableError
from shared.protocol import decode
from shared.protocol.kv import PoolInfo

log = logging.getLogger(__name__)


class RpcTransport(Protocol):
    async def acall(self, op: int, payload: bytes, timeout_s: float) -> tuple[int, bytes]: ...

    def close(self) -> None: ...


class SyncRpcTransport(RpcTransport, Protocol):
    def call(self, op: int, payload: bytes, timeout_s: float) -> tuple[int, bytes]: ...


def geometry_of(info: PoolInfo) -> PoolGeometry:
    return PoolGeometry(info.slot_bytes, info.num_slots, info.num_devices, info.interleave_bytes)


class PoolClient:
    def __init__(self, info: PoolInfo, transport: RpcTransport, memory: PoolMemory | None) -> None:
        self.info = info
        self.transport = transport
        self.memory = memory

    @property
    def is_local(self) -> bool:
        """Operations through shared memory (synchronous calls in µs) and the memory mapped."""
        from shared.cxl.client import RpcClient

        return self.memory is not None and isinstance(self.transport, RpcClient)

    @classmethod
    async def connect(cls, bus: Bus, pool_id: str, *, timeout_s: float = 2.0) -> PoolClient:
        from shared.cxl.client import RpcClient
        from shared.cxl.nats_rpc import NatsRpcClient

        remote = NatsRpcClient(bus, bus.subjects.cxl_rpc(pool_id), client_id=random.getrandbits(32))
        status, data = await remote.acall(Op.INFO, b"", timeout_s)
        _check(status, data, "info")
        info = decode(data, PoolInfo)
        transport: RpcTransport = remote
        try:
            transport = RpcClient(info.rpc_segment)
        except (OSError, KvpathError) as exc:  # another host, or no shared /dev/shm: NATS it is
            log.info("pool %s: CXL-RPC segment not attachable (%s); operations over NATS", pool_id, exc)
        memory = None
        try:
            memory = PoolMemory.open(geometry_of(info), info.device_paths)
        except (OSError, KvpathError) as exc:
            log.info("pool %s: devices not mappable here (%s); no block access", pool_id, exc)
        return cls(info, transport, memory)

    def close(self) -> None:
        self.transport.close()
        if self.memory is not None:
            self.memory.close()

    # ------------------------------------------------------------------------------------- operations

    async def lookup(
        self, hashes: Sequence[int], *, pin: bool, lease_ms: int, timeout_s: float
    ) -> LookupReply:
        data = await self._acall(Op.LOOKUP, ops.encode_lookup(hashes, pin=pin, lease_ms=lease_ms), timeout_s)
        return ops.decode_lookup_reply(data)

    def lookup_now(
        self, hashes: Sequence[int], *, pin: bool, lease_ms: int, timeout_s: float
    ) -> LookupReply:
        """LOOKUP synchronously (shared-memory transport only): µs when the pool is polling, a futex wake
        (~0.1-0.4 ms) when it slept, without the thread hop an `acall` that outlives its spin takes."""
        data = self._call(Op.LOOKUP, ops.encode_lookup(hashes, pin=pin, lease_ms=lease_ms), timeout_s)
        return ops.decode_lookup_reply(data)

    def alloc_now(
        self, hashes: Sequence[int], parents: Sequence[int], *, lease_ms: int, timeout_s: float
    ) -> list[int]:
        """ALLOC synchronously (shared-memory transport only: µs, no event-loop hop)."""
        return ops.decode_slots(
            self._call(Op.ALLOC, ops.encode_alloc(hashes, parents, lease_ms=lease_ms), timeout_s)
        )

    async def alloc(
        self, hashes: Sequence[int], parents: Sequence[int], *, lease_ms: int, timeout_s: float
    ) -> list[int]:
        payload = ops.encode_alloc(hashes, parents, lease_ms=lease_ms)
        return ops.decode_slots(await self._acall(Op.ALLOC, payload, timeout_s))

    async def commit(self, hashes: Sequence[int], checksums: Sequence[int], *, timeout_s: float) -> list[int]:
        """Publish the blocks: each one's commit generation, in order (0: not committed, e.g. not ours)."""
        data = await self._acall(Op.COMMIT, ops.encode_commit(hashes, checksums), timeout_s)
        return ops.decode_generations(data)

    async def unpin(self, lease_id: int, *, timeout_s: float) -> bool:
        return (await self._acall(Op.UNPIN, ops.encode_lease(lease_id), timeout_s)) == b"\x01"

    async def free(self, hashes: Sequence[int], *, timeout_s: float) -> int:
        return ops.decode_count(await self._acall(Op.FREE, ops.encode_hashes(hashes), timeout_s))

    async def stats(self, *, timeout_s: float) -> bytes:
        return await self._acall(Op.STATS, b"", timeout_s)

    async def _acall(self, op: Op, payload: bytes, timeout_s: float) -> bytes:
        status, data = await self.transport.acall(op, payload, timeout_s)
        return _check(status, data, op.name.lower())

    def _call(self, op: Op, payload: bytes, timeout_s: float) -> bytes:
        if not self.is_local:
            raise ServiceUnavailableError("synchronous pool calls need the shared-memory transport")
        status, data = self.transport.call(op, payload, timeout_s)  # type: ignore[attr-defined]
        return _check(status, data, op.name.lower())


def _check(status: int, data: bytes, what: str) -> bytes:
    if status == PoolStatus.OK:
        return data
    message = bytes(data).decode(errors="replace") or f"status {status}"
    if status in (PoolStatus.BAD_REQUEST, PoolStatus.UNKNOWN_OP):
        raise InvalidRequestError(f"pool {what}: {message}")
    raise ServiceUnavailableError(f"pool {what} failed (status {status}): {message}")

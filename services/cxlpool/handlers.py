"""The pool's two transports, both thin over `PoolCore.handle`: the CXL-RPC server (a thread polling the
shared-memory rings of clients on this host) and the NATS responder (everyone else; same operations, same
bytes). A client is its transport plus its id there, so leases and allocations of one never mix with
another's; a CXL-RPC client that dies has them released at once."""

from __future__ import annotations

import logging
from typing import Any

from services.cxlpool import metrics
from services.cxlpool.core import PoolCore
from shared.bus import Bus
from shared.cxl.pool_ops import Op, PoolStatus

log = logging.getLogger(__name__)


def _op_name(op: int) -> str:
    try:
        return Op(op).name.lower()
    except ValueError:
        return "unknown"


class PoolHandlers:
    def __init__(self, core: PoolCore, bus: Bus, rpc_config: Any) -> None:
        self.core = core
        self.bus = bus
        self.rpc_config = rpc_config
        self._rpc: Any = None
        self._nats: Any = None

    async def start(self, segment: str, subject: str) -> None:
        from shared.cxl.nats_rpc import NatsRpcServer
        from shared.cxl.server import RpcServer

        self._rpc = RpcServer(segment, self.shm, config=self.rpc_config, on_client_dead=self.shm_client_dead)
        self._rpc.start()
        self._nats = NatsRpcServer(self.bus, subject, self.nats)
        await self._nats.start()

    async def close(self) -> None:
        if self._nats is not None:
            await self._nats.stop()
        if self._rpc is not None:
            self._rpc.close()

    def shm(self, client_id: int, op: int, payload: memoryview) -> tuple[int, bytes]:
        """CXL-RPC requests (the server's poll thread)."""
        return self._handle(f"shm:{client_id}", op, payload, "shm")

    def nats(self, client_id: int, op: int, payload: memoryview) -> tuple[int, bytes]:
        """NATS requests (the event loop)."""
        return self._handle(f"nats:{client_id}", op, payload, "nats")

    def shm_client_dead(self, client_id: int) -> None:
        metrics.CLIENTS_GONE.inc()
        self.core.release_owner(f"shm:{client_id}")

    def _handle(self, owner: str, op: int, payload: memoryview, transport: str) -> tuple[int, bytes]:
        metrics.OPS.labels(_op_name(op), transport).inc()
        status, reply = self.core.handle(owner, op, payload)
        if status != PoolStatus.OK:
            metrics.BAD_REQUESTS.inc()
            log.warning(
                "pool request refused owner=%s op=%d: %s", owner, op, reply[:200].decode(errors="replace")
            )
        return status, reply

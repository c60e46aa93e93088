"""KV pool service (Beluga): owns the pool's memory and block table, serves them over CXL-RPC and NATS.

On start it creates (or opens, for DAX/hugetlbfs paths) the devices, sizes the slots to one Full Block of
the configured model and KV dtype, starts the CXL-RPC server thread (a shared-memory segment next to the
devices) and the NATS responder, and announces itself: its `PoolInfo` in the registry, and a `Cleared` KV
event for `cxl:<pool_id>` (a fresh pool holds nothing). Blocks committed and evicted are announced as KV
events for that location, so the index can say which prefixes the pool holds. A background task reclaims
read leases and write allocations past their deadline; the RPC server reports clients that died, whose
leases and allocations are released at once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from services.cxlpool import metrics
from services.cxlpool.block_table import BlockTable
from services.cxlpool.config import PoolConfig
from services.cxlpool.core import PoolCore
from services.cxlpool.handlers import PoolHandlers
from shared.cxl.pool_memory import PoolGeometry, PoolMemory
from shared.errors import ConfigError, KvpathError
from shared.kvclient import KvEventPublisher
from shared.protocol import LoadReport, ServiceInfo
from shared.protocol.kv import PoolInfo
from shared.service import Service
from shared.transport import host_id

log = logging.getLogger(__name__)

EVENT_CHUNK = 4096  # blocks per KV event
SWITCH_INTERVAL_S = 0.0005


class PoolService(Service):
    service_kind = "cxlpool"

    def __init__(self, config: PoolConfig) -> None:
        super().__init__(config)
        self.config: PoolConfig = config
        self.pool_id = config.pool_id or self.service_id
        self.location = f"cxl:{self.pool_id}"
        self.events = KvEventPublisher(self.bus, f"pool-{self.pool_id}")
        self.memory: PoolMemory | None = None
        self.core: PoolCore | None = None
        self.handlers: PoolHandlers | None = None
        self._changed = asyncio.Event()

    def role(self) -> str:
        return "cxlpool"

    async def on_start(self) -> None:
        # the CXL-RPC poll thread and this event loop share the GIL: hand it over often, so NATS requests
        # and health probes are not held up for the default 5 ms behind a spinning poll
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        info = self._build_pool()
        loop = asyncio.get_running_loop()
        assert self.memory is not None
        table = BlockTable(info.num_slots, first_generation=info.epoch)  # generations never repeat
        self.core = PoolCore(
            table,
            info,
            default_lease_ms=self.config.lease_ms,
            on_change=lambda: self._notify(loop),
        )
        metrics.bind_stats(table.snapshot_stats)
        self.handlers = PoolHandlers(self.core, self.bus, self._rpc_config())
        await self.handlers.start(info.rpc_segment, self.bus.subjects.cxl_rpc(self.pool_id))
        try:
            await self.events.start()
            await self.events.cleared([self.location], reason="pool started")
        except KvpathError as exc:  # keep serving: the index just will not know the pool's blocks
            log.warning("KV events unavailable pool=%s: %s", self.pool_id, exc.message)
        self.spawn(self._announce_changes(), "announce-changes")
        self.spawn(self._expire(), "expire")
        log.info(
            "pool %s: %d slots of %d bytes on %d devices (%s), rpc segment %s",
            self.pool_id, info.num_slots, info.slot_bytes, info.num_devices,
            "dax/hugetlbfs" if self.config.device_paths else "/dev/shm", info.rpc_segment,
        )  # fmt: skip

    def _build_pool(self) -> PoolInfo:
        from gpu.model_spec import engine_dtype, load_model_spec

        c = self.config
        spec = load_model_spec(c.model, c.model_cache_dir or None)
        dtype = engine_dtype(c.dtype)
        slot_bytes = spec.num_layers * c.block_size * spec.kv_bytes_per_token_layer(dtype)
        num_slots = c.capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ConfigError(
                f"capacity_bytes={c.capacity_bytes} holds no {slot_bytes}-byte block", param="capacity_bytes"
            )
        geometry = PoolGeometry(slot_bytes, num_slots, c.num_devices, c.interleave_bytes)
        prefix = f"kvpath-{c.namespace}-pool-{self.pool_id}"
        if c.device_paths:
            self.memory = PoolMemory.open(geometry, c.device_paths)
        else:
            self.memory = PoolMemory.create(geometry, prefix)
        return PoolInfo(
            pool_id=self.pool_id,
            epoch=time.time_ns(),
            fingerprint=spec.fingerprint(dtype, c.block_size),
            block_size=c.block_size,
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            num_devices=c.num_devices,
            interleave_bytes=c.interleave_bytes,
            device_paths=self.memory.paths,
            rpc_segment=f"{prefix}-rpc",
            host_id=host_id(),
        )

    def _notify(self, loop: asyncio.AbstractEventLoop) -> None:
        """From any thread (the RPC poll thread): wake the announcer."""
        loop.call_soon_threadsafe(self._changed.set)

    def _rpc_config(self) -> Any:
        from shared.cxl.rpc_config import RpcConfig

        c = self.config
        return RpcConfig(
            num_clients=c.rpc_clients, queue_depth=c.rpc_queue_depth, payload_bytes=c.rpc_payload_bytes
        )

    async def _announce_changes(self) -> None:
        """Publish committed and evicted blocks as KV events of `cxl:<pool_id>`, batched."""
        assert self.core is not None
        while True:
            await self._changed.wait()
            self._changed.clear()
            for change in self.core.take_changes():
                try:
                    for i in range(0, len(change.stored), EVENT_CHUNK):
                        part = slice(i, i + EVENT_CHUNK)
                        block_tokens = self.config.block_size
                        await self.events.stored(
                            self.location,
                            change.stored[part],
                            change.parents[part],
                            block_tokens=block_tokens,
                        )
                    for i in range(0, len(change.removed), EVENT_CHUNK):
                        await self.events.removed(
                            self.location, change.removed[i : i + EVENT_CHUNK], reason="evicted"
                        )
                except KvpathError as exc:
                    metrics.EVENTS_FAILED.inc()
                    log.warning("KV event publish failed pool=%s: %s", self.pool_id, exc.message)

    async def _expire(self) -> None:
        assert self.core is not None
        while True:
            await asyncio.sleep(self.config.expire_interval_s)
            self.core.expire()

    async def on_stop(self) -> None:
        if self.handlers is not None:
            await self.handlers.close()
        if self.memory is not None:
            self.memory.close()

    def load_report(self, seq: int) -> LoadReport | None:
        if self.core is None:
            return None
        stats = self.core.table.snapshot_stats()
        return LoadReport(
            service_id=self.service_id,
            role="cxlpool",
            node=self.config.node,
            seq=seq,
            sent_at=time.time(),
            free_kv_blocks=stats.num_free,
            total_kv_blocks=stats.num_slots,
            is_draining=self.status != "ready",
        )

    def service_info(self) -> ServiceInfo:
        info = super().service_info()
        info.model = self.config.model
        if self.core is not None:
            info.extra["pool"] = self.core.info.to_dict()
        return info

    def health(self) -> dict[str, Any]:
        details = super().health()
        if self.core is not None:
            details["pool"] = self.core.stats()
        return details

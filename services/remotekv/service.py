"""The remote KV store service: a DRAM region of super blocks on the KV data plane, metadata on the bus.

The region is registered with the store's `KvReceiver`, so engines write super blocks into it one-sidedly
after a PUT; for a GET the store writes them into the engine's region with its own `KvSender`. Subjects:
`remotekv.<store_id>.info|put|commit|get|exist` (request/reply). Load reports (`load.remotekv.<id>`) carry
GETs in flight (`num_running`), open PUT reservations (`num_waiting`) and bytes used / capacity (`rates`).
Nothing survives a restart: a new `epoch` tells engines the old offsets mean nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from services.remotekv import metrics
from services.remotekv.chunk_writer import ChunkWriter
from services.remotekv.config import RemoteKvConfig
from services.remotekv.handlers import RemoteKvHandlers, StoreIdentity
from services.remotekv.slot_table import SlotTable
from shared.protocol import LoadReport, ServiceInfo
from shared.protocol.kv import RemoteKvCommit, RemoteKvExist, RemoteKvGet, RemoteKvInfoRequest, RemoteKvPut
from shared.service import Service
from shared.transport import KvReceiver, KvSender, TransportConfig

log = logging.getLogger(__name__)

REGION = "remotekv"


class RemoteKvService(Service):
    service_kind = "remotekv"

    def __init__(self, config: RemoteKvConfig) -> None:
        super().__init__(config)
        self.config: RemoteKvConfig = config
        self.table = SlotTable(config.capacity_bytes)
        self.receiver: KvReceiver | None = None
        self.sender: KvSender | None = None
        self.writer: ChunkWriter | None = None
        self.handlers: RemoteKvHandlers | None = None

    def role(self) -> str:
        return "remotekv"

    async def on_start(self) -> None:
        c = self.config
        tcfg = TransportConfig(
            bind_host=c.kv_bind_host, advertise_host=c.advertise_host, backends=list(c.kv_backends)
        )
        self.receiver = KvReceiver(tcfg, receiver_id=self.service_id)
        await self.receiver.start()
        region = self.receiver.register_region(REGION, c.capacity_bytes)
        self.sender = KvSender(tcfg, sender_id=self.service_id)
        self.sender.register_memory(region.array())  # rdma: GETs write from any slot without per-op MRs
        self.writer = ChunkWriter(self.sender)
        identity = StoreIdentity(self.service_id, time.time_ns(), REGION, self.receiver.endpoint())
        self.handlers = h = RemoteKvHandlers(
            self.table, region.array(), self.writer, identity, c, self.report_load_now
        )
        metrics.bind_table(self.table, lambda: h.num_gets_in_flight)
        op = self.bus.subjects.remotekv
        await self.bus.subscribe(op(self.service_id, "info"), RemoteKvInfoRequest, h.info)
        await self.bus.subscribe(op(self.service_id, "put"), RemoteKvPut, h.put)
        await self.bus.subscribe(op(self.service_id, "commit"), RemoteKvCommit, h.commit)
        await self.bus.subscribe(op(self.service_id, "exist"), RemoteKvExist, h.exist)
        await self.bus.subscribe(
            op(self.service_id, "get"), RemoteKvGet, h.get, max_concurrency=c.max_concurrent_gets
        )
        self.spawn(self._reap_reservations(), "reaper")
        log.info(
            "remotekv store=%s capacity=%dB chunk_tokens=%d",
            self.service_id,
            c.capacity_bytes,
            c.chunk_tokens,
        )

    async def _reap_reservations(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            expired = self.table.reap(time.monotonic())
            if expired:
                metrics.EXPIRED.inc(expired)
                self.report_load_now()

    async def on_drain(self, deadline: float) -> None:
        # GETs in flight finish writing out; reservations need no hand-off (the store's contents die with it)
        if self.handlers is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.handlers.is_idle.wait(), max(0.0, deadline - time.monotonic()))

    async def on_stop(self) -> None:
        if self.writer is not None:
            await self.writer.close()
        for end in (self.sender, self.receiver):
            if end is not None:
                with contextlib.suppress(Exception):
                    await end.close()

    def load_report(self, seq: int) -> LoadReport | None:
        if self.handlers is None:
            return None
        t = self.table
        return LoadReport(
            service_id=self.service_id,
            role="remotekv",
            node=self.config.node,
            seq=seq,
            sent_at=time.time(),
            num_running=self.handlers.num_gets_in_flight,
            num_waiting=t.num_reservations,
            is_draining=self.status == "draining",
            rates={
                "used_bytes": float(t.used_bytes),
                "capacity_bytes": float(t.capacity_bytes),
                "num_chunks": float(t.num_committed),
            },
        )

    def service_info(self) -> ServiceInfo:
        info = super().service_info()
        if self.receiver is not None:
            info.extra["kv_endpoint"] = self.receiver.endpoint()
            info.endpoints.update(self.receiver.service_endpoints())
        return info

    def health(self) -> dict[str, Any]:
        out = super().health()
        t = self.table
        out.update(
            chunks=t.num_committed,
            used_bytes=t.used_bytes,
            capacity_bytes=t.capacity_bytes,
            chunk_bytes=t.chunk_bytes,
            chunk_tokens=self.config.chunk_tokens,
            gets_in_flight=self.handlers.num_gets_in_flight if self.handlers else 0,
        )
        return out

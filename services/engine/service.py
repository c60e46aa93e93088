"""Engine service: loads the model runtime, builds its role's KV connector, wires handlers, reports load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from services.engine import metrics
from services.engine.config import EngineConfig, prompt_buffer_bytes
from services.engine.connector import KvConnector, NullConnector
from services.engine.core import EngineCore
from services.engine.handlers import EngineHandlers
from services.engine.router_watch import RouterWatch
from services.engine.warmup import seed_prefill_rates
from shared.blocks import BlockLayout
from shared.protocol import Abort, LoadReport, ServiceInfo, TokenBatch, TokenResend
from shared.protocol.tasks import PullHits
from shared.service import Service

log = logging.getLogger(__name__)


class EngineService(Service):
    service_kind = "engine"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.config: EngineConfig = config
        self.runner: Any = None
        self.core: EngineCore | None = None
        self.connector: KvConnector | None = None
        self.receiver: Any = None  # KV data plane (prefill / decode roles)
        self.sender: Any = None
        self.peers: Any = None
        self.upper_tier: Any = None  # a KV tier above storage (the pool; colocated: or the remote store)

    def role(self) -> str:
        return self.config.role

    async def on_start(self) -> None:
        self.runner = await asyncio.to_thread(load_runner, self.config)
        if self.config.role != "colocated" or self.config.kv_remote or self.config.move_query:
            await self._start_data_plane()
        if self.config.kv_pool:
            self.upper_tier = await connect_pool(self.config, self)
        if self.config.kv_remote:
            self.upper_tier = await start_remote_tier(self.config, self)
        self.connector = build_connector(self.config, self)
        if self.config.move_query:  # move the query: routes held prefixes, holds chunks (route.py)
            from services.engine.route import build_route_connector

            self.connector = build_route_connector(self.config, self, self.connector)
        await self.connector.start()
        self.core = EngineCore(
            self.config, self.runner, self.service_id, self._publish_tokens, self.connector
        )
        prefills = self.config.role != "decode" or self.config.session_kv  # DualPath's DEs never do
        warmup = self.config.warmup_prefill_tokens if prefills else 0
        rate = await seed_prefill_rates(self.runner, self.core.prefill_rates, warmup)
        log.info("warm-up prefill: %d tokens at %.0f tokens/s", warmup, rate)
        metrics.KV_BLOCKS_TOTAL.set(self.runner.kv.num_blocks)
        handlers = EngineHandlers(self.core, self.report_load_now)
        subjects = self.bus.subjects
        await self.bus.subscribe(subjects.task(self.service_id), self.connector.task_type, handlers.task)
        if self.connector.serves_pulls:
            await self.bus.subscribe(
                subjects.transfer(self.service_id), PullHits, handlers.pull, max_concurrency=256
            )
        await self.bus.subscribe(subjects.abort, Abort, handlers.abort)
        await self.bus.subscribe(subjects.resend(self.service_id), TokenResend, handlers.resend)
        holder = getattr(self.connector, "holder", None)
        if holder is not None:
            await self.bus.subscribe(
                subjects.route(self.service_id), holder.message_types, holder.handle, max_concurrency=64
            )
        self.spawn(self.core.run(), "step-loop")
        watch = RouterWatch(self.registry, self.core, self.config.registry_ttl_s)
        self.spawn(watch.run(), "router-watch")

    async def _start_data_plane(self) -> None:
        from services.engine.peers import PeerPool
        from shared.transport import KvReceiver, KvSender, TransportConfig

        tcfg = TransportConfig(
            bind_host=self.config.kv_bind_host,
            advertise_host=self.config.advertise_host,
            backends=list(self.config.kv_backends),
        )
        tcfg.validate()
        self.receiver = KvReceiver(tcfg, receiver_id=self.service_id)
        await self.receiver.start()
        self.sender = KvSender(tcfg, sender_id=self.service_id)
        self.peers = PeerPool(self.sender)

    async def _publish_tokens(self, router_id: str, batch: TokenBatch) -> None:
        await self.bus.publish(self.bus.subjects.tokens(router_id), batch)

    async def on_drain(self, deadline: float) -> None:
        if self.core is None:
            return
        self.core.is_draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.core.is_idle.wait(), max(0.0, deadline - time.monotonic()))

    async def on_stop(self) -> None:
        if self.core is not None:
            await self.core.close()
        if self.connector is not None:
            with contextlib.suppress(Exception):
                await self.connector.close()
        if self.peers is not None:
            await self.peers.close()
        for end in (self.sender, self.receiver):
            if end is not None:
                with contextlib.suppress(Exception):
                    await end.close()
        if self.runner is not None:
            self.runner.close()

    def load_report(self, seq: int) -> LoadReport | None:
        if self.core is None:
            return None
        load = self.core.load()
        load["rates"].update(self.connector.stats() if self.connector is not None else {})
        metrics.KV_BLOCKS_USED.set(load["total_kv_blocks"] - load["free_kv_blocks"])
        metrics.RUNNING.set(load["num_running"])
        metrics.WAITING.set(load["num_waiting"])
        return LoadReport(
            service_id=self.service_id,
            role=self.config.role,
            node=self.config.node,
            seq=seq,
            sent_at=time.time(),
            is_draining=self.core.is_draining or self.status != "ready",
            kv_format=self.core.kv_format,
            route=self.connector.route_capability() if self.connector is not None else None,
            max_num_batched_tokens=self.core.scheduler.max_num_batched_tokens,
            compute_id=self.runner.compute_id,
            **load,
        )

    def service_info(self) -> ServiceInfo:
        info = super().service_info()
        info.model = self.config.model
        if self.core is not None:
            info.kv_format = self.core.kv_format
        holder = getattr(self.connector, "holder", None)
        if holder is not None:  # move the query: the chunks this engine holds (also `held:<id>` in the index)
            info.extra["held_chunks"] = [c.to_dict() for c in holder.held.infos()]
        if self.receiver is not None:
            info.extra["kv_endpoint"] = self.receiver.endpoint()
            info.endpoints.update(self.receiver.service_endpoints())
        return info

    def health(self) -> dict[str, Any]:
        details = super().health()
        if self.core is not None:
            details.update(self.core.load())
        return details


def load_runner(config: EngineConfig) -> Any:
    """The model runtime on the configured device (blocking: run it in a thread)."""
    from gpu.runner import ModelRunner

    return ModelRunner.load(
        config.model,
        device=config.device,
        dtype=config.dtype or None,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks or None,
        kv_cache_bytes=config.kv_cache_bytes or None,  # num_kv_blocks, when set, wins
        cache_dir=config.model_cache_dir or None,
        num_threads=config.num_threads or None,
    )


def build_connector(config: EngineConfig, service: EngineService) -> KvConnector:
    """The KV connector of the engine's role (NullConnector: recompute everything, persist nothing)."""
    if config.role in ("prefill", "decode"):
        return build_disaggregated_connector(config, service)
    if not (config.load_kv or config.persist_kv):
        return NullConnector()
    from services.engine.colocated_connector import ColocatedConnector
    from services.engine.node_storage import engine_node_storage

    storage = engine_node_storage(config, service)
    return ColocatedConnector(
        service.runner, storage, load_kv=config.load_kv, persist_kv=config.persist_kv, tier=service.upper_tier
    )


def build_disaggregated_connector(config: EngineConfig, service: EngineService) -> KvConnector:
    """A prefill or decode engine's connector, over the KV data plane to its peers."""
    from services.engine.connector_context import ConnectorContext

    ctx = ConnectorContext(
        service.bus,
        service.runner,
        engine_id=service.service_id,
        node=config.node,
        block_size=config.block_size,
        receiver=service.receiver,
        peers=service.peers,
        transfer_timeout_s=config.transfer_timeout_s,
        tier=service.upper_tier,
        step_tokens=config.max_num_batched_tokens,
        staging_bytes=config.storage_staging_bytes,
    )
    runner = service.runner

    def prompts(configured: int) -> int:
        full_block_bytes = runner.kv.full_block_bytes
        return prompt_buffer_bytes(configured, full_block_bytes, runner.spec.max_model_len, config.block_size)

    if config.role == "prefill":
        from services.engine.prefill_connector import PrefillConnector

        return PrefillConnector(
            ctx, area_bytes=prompts(config.pe_receive_bytes), staging_bytes=prompts(config.pe_staging_bytes)
        )
    area_bytes = prompts(config.de_buffer_bytes)
    if config.session_kv:
        from services.engine.session_connector import SessionConnector

        return SessionConnector(
            ctx,
            persist_kv=config.persist_kv,
            area_bytes=area_bytes,
            staging_bytes=prompts(config.session_staging_bytes),
        )
    from services.engine.decode_connector import DecodeConnector

    return DecodeConnector(ctx, persist_kv=config.persist_kv, area_bytes=area_bytes)


async def connect_pool(config: EngineConfig, service: EngineService) -> Any:
    """The pool tier (Beluga), or None when the pool cannot be used from here: not reachable in time, its
    memory not mappable from this process, or holding another KV format (each logged once, at start)."""
    from services.engine.pool_tier import PoolTier
    from shared.cxl.pool_client import PoolClient
    from shared.errors import KvpathError

    deadline = time.monotonic() + config.pool_connect_timeout_s
    while True:
        try:
            client = await PoolClient.connect(service.bus, config.kv_pool)
            break
        except KvpathError as exc:
            if time.monotonic() > deadline:
                log.error("pool %s not reachable (%s): serving without it", config.kv_pool, exc.message)
                return None
            await asyncio.sleep(0.5)
    runner = service.runner
    layout = BlockLayout(runner.spec.num_layers, config.block_size, runner.kv.bytes_per_token_layer)
    problem = ""
    if client.memory is None:
        problem = "its memory is not mappable here"
    elif client.info.fingerprint != runner.fingerprint or client.info.slot_bytes != layout.full_block_bytes:
        problem = f"it holds KV format {client.info.fingerprint!r}, this engine {runner.fingerprint!r}"
    if problem:
        log.error("pool %s unusable: %s; serving without it", config.kv_pool, problem)
        client.close()
        return None
    return PoolTier(
        client,
        layout,
        runner.kv,
        verify_checksums=config.pool_verify_checksums,
        lease_ms=config.pool_lease_ms,
        prefault=config.pool_prefault,
    )


async def start_remote_tier(config: EngineConfig, service: EngineService) -> Any:
    """The remote-memory tier (`--kv-remote`, the RDMA-pool baseline): a local super-block cache registered
    on the engine's data plane in front of the store. A store not up yet is fine: the tier links on use."""
    from services.engine.remote_client import ChunkFormat, RemoteStoreClient
    from services.engine.remote_events import CacheAnnouncer
    from services.engine.remote_tier import RemoteTier
    from shared.hashing import fingerprint_seed

    runner = service.runner
    layout = BlockLayout(runner.spec.num_layers, config.block_size, runner.kv.bytes_per_token_layer)
    chunk_blocks = config.remote_chunk_tokens // config.block_size
    fmt = ChunkFormat(runner.fingerprint, config.remote_chunk_tokens, chunk_blocks * layout.full_block_bytes)
    client = RemoteStoreClient(
        service.bus, config.kv_remote, service.sender, fmt, timeout_s=config.remote_timeout_s
    )
    tier = RemoteTier(
        client,
        service.receiver,
        CacheAnnouncer(service.bus, service.service_id, block_tokens=config.block_size),
        layout,
        runner.kv,
        engine_id=service.service_id,
        seed=fingerprint_seed(runner.fingerprint),
        chunk_blocks=chunk_blocks,
        cache_bytes=config.remote_cache_bytes,
        verify_checksums=config.remote_verify_checksums,
    )
    await tier.start()
    return tier

"""Engine service: wraps the model runtime; takes tasks, streams tokens, reports load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from services.engine import metrics
from services.engine.config import EngineConfig
from services.engine.connector import KvConnector
from services.engine.core import EngineCore
from services.engine.decode_connector import DecodeConnector as DecodeConnectorT
from services.engine.prefill_connector import PrefillConnector as PrefillConnectorT
from services.engine.sequence import Sequence
from shared import logs, telemetry
from shared.bus import MsgContext
from shared.errors import KvpathError
from shared.protocol import Abort, GenerateTask, LoadReport, ServiceInfo, TaskAck, TokenBatch
from shared.protocol.disagg import DecodeAck, DecodeTask, PrefillTask, PullHits, PullHitsReply
from shared.service import Service

log = logging.getLogger(__name__)


class EngineService(Service):
    service_kind = "engine"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.config: EngineConfig = config
        self.runner: Any = None
        self.core: EngineCore | None = None
        self._connector: KvConnector | None = None
        self.receiver: Any = None  # KV data plane (prefill / decode roles)
        self.sender: Any = None
        self.peers: Any = None

    def role(self) -> str:
        return self.config.role

    def build_connector(self) -> KvConnector | None:
        """The KV connector for this engine's role and config (None: recompute everything)."""
        cfg = self.config
        if cfg.role == "prefill":
            return PrefillConnectorT(
                self.bus,
                self.runner,
                engine_id=self.service_id,
                node=cfg.node,
                block_size=cfg.block_size,
                receiver=self.receiver,
                peers=self.peers,
                area_bytes=cfg.pe_receive_bytes,
                staging_bytes=cfg.pe_staging_bytes,
                transfer_timeout_s=cfg.transfer_timeout_s,
            )
        if cfg.role == "decode":
            return DecodeConnectorT(
                self.bus,
                self.runner,
                engine_id=self.service_id,
                node=cfg.node,
                block_size=cfg.block_size,
                persist_kv=cfg.persist_kv,
                receiver=self.receiver,
                peers=self.peers,
                area_bytes=cfg.de_buffer_bytes,
                transfer_timeout_s=cfg.transfer_timeout_s,
            )
        if not (cfg.load_kv or cfg.persist_kv):
            return None
        from services.engine.storage_connector import StorageConnector

        return StorageConnector(
            self.bus,
            self.runner,
            node=cfg.node,
            block_size=cfg.block_size,
            load_kv=cfg.load_kv,
            persist_kv=cfg.persist_kv,
            engine_id=self.service_id,
        )

    async def on_start(self) -> None:
        from gpu.runner import ModelRunner

        cfg = self.config
        device = cfg.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.runner = await asyncio.to_thread(
            ModelRunner.load,
            cfg.model,
            device=device,
            dtype=cfg.dtype or None,
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks or None,
            kv_cache_bytes=None if cfg.num_kv_blocks else cfg.kv_cache_bytes,
            cache_dir=cfg.model_cache_dir or None,
            num_threads=cfg.num_threads or None,
        )
        if cfg.role != "colocated":
            await self._start_data_plane()
        self._connector = self.build_connector()
        if self._connector is not None:
            await self._connector.start()
        self.core = EngineCore(cfg, self.runner, self.service_id, self._publish_tokens, self._connector)
        metrics.KV_BLOCKS_TOTAL.set(self.runner.kv.num_blocks)
        subjects = self.bus.subjects
        handlers = {
            "colocated": (GenerateTask, self._on_task),
            "prefill": (PrefillTask, self._on_prefill_task),
            "decode": (DecodeTask, self._on_decode_task),
        }
        task_type, handler = handlers[cfg.role]
        await self.bus.subscribe(subjects.task(self.service_id), task_type, handler)  # type: ignore[arg-type]
        if cfg.role == "decode":
            await self.bus.subscribe(
                subjects.transfer(self.service_id), PullHits, self._on_pull, max_concurrency=256
            )
        await self.bus.subscribe(subjects.abort, Abort, self._on_abort)
        self.spawn(self.core.run(), "step-loop")

    async def _start_data_plane(self) -> None:
        from services.engine.disagg import PeerPool
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

    # Task handlers run with the request id bound for logs and the router's trace context current, so the
    # tasks they start (prefix fetch, DE-side read) log and trace as part of the request.

    async def _on_task(self, task: GenerateTask, ctx: MsgContext) -> TaskAck:
        assert self.core is not None
        parent = ctx.trace_parent
        with logs.request_context(task.request_id), telemetry.attached(parent):
            ack = self.core.submit(task, trace_parent=parent)
            self._log_admission(task.request_id, len(task.prompt_token_ids), ack.accepted, ack.code)
        if ack.accepted:
            self.report_load_now()
        return ack

    async def _on_prefill_task(self, task: PrefillTask, ctx: MsgContext) -> TaskAck:
        assert isinstance(self._connector, PrefillConnectorT)
        connector = self._connector

        def bind(seq: Sequence) -> None:
            seq.timings.update(task.timings)
            connector.bind(seq, task)

        refusal = self._take(task, ctx, bind)
        if refusal is not None:
            return TaskAck(
                request_id=task.request_id, accepted=False, code=refusal.code, message=refusal.message
            )
        return TaskAck(request_id=task.request_id, accepted=True)

    async def _on_decode_task(self, task: DecodeTask, ctx: MsgContext) -> DecodeAck:
        assert isinstance(self._connector, DecodeConnectorT)
        connector, refs = self._connector, []
        refusal = self._take(task, ctx, lambda seq: refs.append(connector.accept(seq, task)))
        if refusal is not None:
            return DecodeAck(
                request_id=task.request_id, accepted=False, code=refusal.code, message=refusal.message
            )
        return DecodeAck(request_id=task.request_id, accepted=True, buffer=refs[0])

    def _take(
        self, task: PrefillTask | DecodeTask, ctx: MsgContext, bind: Callable[[Sequence], None]
    ) -> KvpathError | None:
        """Admit a prefill/decode task, let the connector bind it, start it; the refusal, if any."""
        assert self.core is not None
        parent = ctx.trace_parent
        with logs.request_context(task.request_id), telemetry.attached(parent):
            try:
                seq = self.core.admit(
                    task.request_id,
                    task.router_id,
                    task.prompt_token_ids,
                    task.sampling,
                    task.deadline_unix_s,
                    trace_parent=parent,
                )
                bind(seq)
            except KvpathError as exc:
                self._log_admission(task.request_id, len(task.prompt_token_ids), False, exc.code)
                return exc
            self.core.start(seq)
            self._log_admission(task.request_id, len(task.prompt_token_ids), True, "")
        self.report_load_now()
        return None

    def _log_admission(self, request_id: str, prompt_tokens: int, accepted: bool, code: str) -> None:
        if accepted:
            log.debug("task accepted request_id=%s prompt_tokens=%d", request_id, prompt_tokens)
        else:
            log.debug("task refused request_id=%s code=%s", request_id, code)

    async def _on_pull(self, msg: PullHits, ctx: MsgContext) -> PullHitsReply:
        assert isinstance(self._connector, DecodeConnectorT)
        with logs.request_context(msg.request_id), telemetry.span("kv.pull", parent=ctx.trace_parent) as span:
            if span is not None:
                span.set_attribute("request_id", msg.request_id)
            return await self._connector.serve_pull(msg)

    async def _on_abort(self, msg: Abort, ctx: MsgContext) -> None:
        if self.core is not None:
            self.core.abort(msg.request_id, msg.reason or "abort")

    async def on_drain(self, deadline: float) -> None:
        if self.core is None:
            return
        self.core.is_draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.core.is_idle.wait(), max(0.0, deadline - time.monotonic()))

    async def on_stop(self) -> None:
        if self.core is not None:
            await self.core.close()
        if self._connector is not None:
            with contextlib.suppress(Exception):
                await self._connector.close()
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
            **load,
        )

    def service_info(self) -> ServiceInfo:
        info = super().service_info()
        info.model = self.config.model
        if self.receiver is not None:
            info.extra["kv_endpoint"] = self.receiver.endpoint()
            info.endpoints.update(self.receiver.service_endpoints())
        return info

    def health(self) -> dict[str, Any]:
        details = super().health()
        if self.core is not None:
            details.update(self.core.load())
        return details

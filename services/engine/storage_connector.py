"""KV connector over the node's storage service (colocated engines): load stored prefixes, persist blocks.

Load: before a sequence is scheduled, its stored prefix (the router's index hit, re-hashed here) is read into
the node's DRAM buffer; during the first prefill chunk, layer l of every loaded block is copied into the
paged cache right before layer l computes. Persist: every block that fills is written (`persist.py`), and
the request's last token waits until those writes are durable and indexed. A missing, corrupt or
unreachable store is a miss or a skipped write, counted by reason, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from typing import Any

from gpu.runner import LayerHook, PrefillSeq
from services.engine import metrics
from services.engine.connector import KvConnector
from services.engine.persist import BlockPersister
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared.blocks import BlockLayout
from shared.bus import Bus
from shared.errors import KvpathError
from shared.kvclient import IndexClient, ReadLease, StorageClient

log = logging.getLogger(__name__)


class LoadHook(LayerHook):
    """Copies layer l of loaded prefix blocks into the cache right before layer l computes."""

    def __init__(self, kv: Any, loads: list[tuple[list[int], ReadLease]]) -> None:
        self.kv = kv
        self.loads = loads

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        for block_ids, lease in self.loads:
            self.kv.import_layer(block_ids, layer, lease.layer(layer))


class StorageConnector(KvConnector):
    def __init__(
        self,
        bus: Bus,
        runner: Any,
        *,
        node: int,
        block_size: int,
        load_kv: bool,
        persist_kv: bool,
        engine_id: str = "",
    ) -> None:
        spec = runner.spec
        self.kv = runner.kv
        self.block_size = block_size
        self.fingerprint = spec.fingerprint(runner.dtype, block_size)
        layout = BlockLayout(spec.num_layers, block_size, self.kv.bytes_per_token_layer)
        self.client = StorageClient(bus, node, layout, self.fingerprint, owner_id=engine_id)
        self.persister = BlockPersister(self.client, IndexClient(bus), self.kv, block_size)
        self.load_kv = load_kv
        self.persist_kv = persist_kv
        self.leases: dict[str, ReadLease] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.persister.close()
        await self.client.close()

    # ------------------------------------------------------------------------------------------- load

    async def prepare(self, seq: Sequence) -> None:
        num_hit = int(seq.kv_plan.get("num_hit_blocks", 0)) if self.load_kv else 0
        # at least one prompt token is computed, to sample the first output token
        num_hit = min(num_hit, (seq.num_prompt_tokens - 1) // self.block_size)
        if num_hit <= 0:
            return
        hashes = self.persister.chain(seq, num_hit)
        remaining_s = seq.deadline_unix_s - time.time()
        try:
            lease = await self.client.read(seq.request_id, hashes, deadline_s=max(0.01, remaining_s))
        except KvpathError as exc:
            metrics.KV_LOAD_MISSES.labels(exc.code).inc(num_hit)
            log.warning("prefix load failed request_id=%s code=%s: %s", seq.request_id, exc.code, exc.message)
            return
        if lease.num_blocks < num_hit:
            metrics.KV_LOAD_MISSES.labels(lease.miss_reason or "missing").inc(num_hit - lease.num_blocks)
        if lease.num_blocks == 0:
            return
        self.leases[seq.request_id] = lease
        self.persister.track(seq, lease.num_blocks)
        seq.num_hit_tokens = lease.num_blocks * self.block_size
        metrics.KV_LOADED_BLOCKS.inc(lease.num_blocks)

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        loads = []
        for c in chunks:
            lease = self.leases.get(c.seq.request_id)
            if c.load_tokens and lease is not None:
                loads.append((c.seq.block_ids[: c.load_tokens // self.block_size], lease))
        return LoadHook(self.kv, loads) if loads else None

    # ---------------------------------------------------------------------------------------- persist

    def after_step(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            if seq.num_cached_tokens:
                self._release_lease(seq.request_id)  # the prefix is in the cache now
            if self.persist_kv:
                self.persister.persist(seq)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        return self.persister.finish(seq.request_id)

    # ---------------------------------------------------------------------------------------- release

    def release(self, seq: Sequence) -> None:
        self._release_lease(seq.request_id)

    def _release_lease(self, request_id: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self._keep(asyncio.ensure_future(lease.release()))

    def _keep(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

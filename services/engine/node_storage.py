"""A KV connector's link to its node's storage service: the storage client, the block persister, stored-prefix
reads, and the background tasks the connector starts (lease releases, buffer drains), cancelled on close.

A prefix read that fails or comes back short is a miss, counted by reason: the request recomputes what was
not read; it never fails because of storage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Any

from services.engine import metrics
from services.engine.persist import BlockPersister
from services.engine.sequence import Sequence
from shared.background import Background
from shared.blocks import BlockLayout
from shared.bus import Bus
from shared.errors import KvpathError
from shared.kvclient import IndexClient, ReadLease, StorageClient

log = logging.getLogger(__name__)


MIN_STAGING_BYTES = 64 * 1024 * 1024


def staging_bytes_for(layout: BlockLayout, step_tokens: int) -> int:
    """The persister's staging segment: room for the blocks two prefill steps of `step_tokens` fill (one
    step's staged while the last one's are written), at least MIN_STAGING_BYTES. A model with much KV
    per token (SmolLM2 in fp32: 2.9 MB per block of 64 tokens) fills 64 MiB in 22 blocks, less than a
    step of 2,048 tokens."""
    step_blocks = -(-step_tokens // layout.block_size) + 1  # a chunk may complete one block it did not start
    return max(MIN_STAGING_BYTES, 2 * layout.blocks_bytes(step_blocks))


def engine_node_storage(config: Any, service: Any) -> NodeStorage:
    """A colocated engine's link to its node's storage service, from its EngineConfig and EngineService."""
    return NodeStorage(
        service.bus, service.runner, node=config.node, block_size=config.block_size,
        engine_id=service.service_id, step_tokens=config.max_num_batched_tokens,
        staging_bytes=config.storage_staging_bytes,
    )  # fmt: skip


class NodeStorage:
    def __init__(
        self,
        bus: Bus,
        runner: Any,
        *,
        node: int,
        block_size: int,
        engine_id: str,
        step_tokens: int = 2048,
        staging_bytes: int = 0,
    ) -> None:
        """`step_tokens`: the engine's prefill tokens per step; `staging_bytes` 0: staging_bytes_for it."""
        self.layout = BlockLayout(runner.spec.num_layers, block_size, runner.kv.bytes_per_token_layer)
        staging = staging_bytes or staging_bytes_for(self.layout, step_tokens)
        self.client = StorageClient(
            bus, node, self.layout, runner.fingerprint, staging_bytes=staging, owner_id=engine_id
        )
        self.persister = BlockPersister(self.client, IndexClient(bus), runner.kv, block_size)
        self._background = Background()

    @property
    def node(self) -> int:
        return self.client.node

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        await self._background.close()
        await self.persister.close()
        await self.client.close()

    def keep(self, work: Awaitable[Any]) -> None:
        """Run `work` in the background; close() cancels it if it is still running."""
        self._background.keep(work)

    def release(self, lease: ReadLease | None) -> None:
        """Give a read lease back (in the background)."""
        if lease is not None:
            self.keep(lease.release())

    async def read_prefix(self, seq: Sequence, num_blocks: int) -> ReadLease | None:
        """Lease the sequence's first `num_blocks` stored blocks in the node buffer (the leading ones that
        read cleanly, maybe fewer); None when none could be read."""
        return await self.read_blocks(seq, 0, num_blocks)

    async def read_blocks(self, seq: Sequence, first: int, end: int) -> ReadLease | None:
        """Lease the sequence's stored blocks [first, end) (a prefix of them that reads cleanly, maybe
        shorter); None when none could be read."""
        num_blocks = end - first
        if num_blocks <= 0:
            return None
        remaining_s = max(0.01, seq.deadline_unix_s - time.time())
        hashes = seq.block_hashes[first:end]
        try:
            lease = await self.client.read(seq.request_id, hashes, deadline_s=remaining_s)
        except KvpathError as exc:
            metrics.KV_LOAD_MISSES.labels(exc.code).inc(num_blocks)
            log.warning("prefix read failed request_id=%s code=%s: %s", seq.request_id, exc.code, exc.message)
            return None
        if lease.num_blocks < num_blocks:
            metrics.KV_LOAD_MISSES.labels(lease.miss_reason or "missing").inc(num_blocks - lease.num_blocks)
        if lease.num_blocks == 0:
            return None
        metrics.KV_LOADED_BLOCKS.inc(lease.num_blocks)
        return lease

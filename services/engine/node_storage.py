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


class NodeStorage:
    def __init__(self, bus: Bus, runner: Any, *, node: int, block_size: int, engine_id: str) -> None:
        self.layout = BlockLayout(runner.spec.num_layers, block_size, runner.kv.bytes_per_token_layer)
        self.client = StorageClient(bus, node, self.layout, runner.fingerprint, owner_id=engine_id)
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

"""Persist every KV block that fills, through the node's storage service (one per engine).

After a step, the blocks of a sequence that became full are exported into the storage client's staging
segment (a memcpy on the loop, so the cache blocks may be freed right after) and written by a background
task. `finish` gives the awaitable a request's last token waits on: its writes durable and applied by the
index (bounded by PERSIST_WAIT_S), so the next turn of a session hits them. A block that cannot be staged
breaks the chain: later blocks of that sequence could never be matched, so they are not written either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from services.engine import metrics
from services.engine.sequence import Sequence
from shared import telemetry
from shared.errors import KvpathError
from shared.hashing import fingerprint_seed, next_block_hash
from shared.kvclient import IndexClient, StagedBlocks, StorageClient

log = logging.getLogger(__name__)

PERSIST_WAIT_S = 2.0  # longest a finished request waits for its blocks to become durable


@dataclass(slots=True)
class _Chain:
    num_persisted_blocks: int  # leading blocks already in the store (loaded or written)
    last_hash: int  # hash of the last of them (the fingerprint seed when none)
    is_broken: bool = False
    writes: list[asyncio.Task[int]] = field(default_factory=list)


class BlockPersister:
    def __init__(self, client: StorageClient, index: IndexClient, kv: Any, block_size: int) -> None:
        self.client = client
        self.index = index
        self.kv = kv
        self.block_size = block_size
        self.seed = fingerprint_seed(client.fingerprint)
        self._chains: dict[str, _Chain] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    def chain(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Hashes of the sequence's first `num_blocks` full blocks."""
        out, parent, bs = [], self.seed, self.block_size
        for i in range(num_blocks):
            parent = next_block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs))
            out.append(parent)
        return out

    def track(self, seq: Sequence, num_stored_blocks: int) -> None:
        """Start tracking a sequence whose first `num_stored_blocks` blocks are in the store already."""
        hashes = self.chain(seq, num_stored_blocks)
        self._chains[seq.request_id] = _Chain(num_stored_blocks, hashes[-1] if hashes else self.seed)

    def persist(self, seq: Sequence) -> None:
        """Write the sequence's blocks that became full since the last call (tracking it if new)."""
        chain = self._chains.get(seq.request_id)
        if chain is None:
            chain = self._chains[seq.request_id] = _Chain(0, self.seed)
        full = seq.num_computed_tokens // self.block_size
        start = chain.num_persisted_blocks
        if full <= start or chain.is_broken:
            return
        try:
            staged = self.client.stage(full - start)
        except KvpathError as exc:
            metrics.KV_PERSIST_FAILURES.labels(exc.code).inc(full - start)
            chain.is_broken = True
            return
        self.kv.export_blocks(seq.block_ids[start:full], staged.views)
        hashes, parents, parent, bs = [], [], chain.last_hash, self.block_size
        for i in range(start, full):
            parents.append(parent)
            parent = next_block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs))
            hashes.append(parent)
        chain.num_persisted_blocks, chain.last_hash = full, parent
        # the write's bus request (and the storage service's span) belongs to the request's trace
        context = telemetry.task_context(seq.trace.parent) if seq.trace is not None else None
        write = self._write(seq.request_id, staged, hashes, parents)
        chain.writes.append(asyncio.create_task(write, context=context))

    async def _write(
        self, request_id: str, staged: StagedBlocks, hashes: list[int], parents: list[int]
    ) -> int:
        try:
            result = await self.client.write(staged, hashes, parents, request_id=request_id)
        except KvpathError as exc:
            metrics.KV_PERSIST_FAILURES.labels(exc.code).inc(len(hashes))
            log.warning(
                "persist failed request_id=%s code=%s: %s", request_id, exc.code, exc.message,
                extra={"request_id": request_id},
            )  # fmt: skip
            return 0
        metrics.KV_PERSISTED_BLOCKS.inc(result.num_written)
        return result.event_stream_seq

    def finish(self, request_id: str) -> Awaitable[None] | None:
        """Forget the request; the awaitable (None: nothing written) ends once its writes are indexed."""
        chain = self._chains.pop(request_id, None)
        if chain is None or not chain.writes:
            return None
        return self._wait_indexed(request_id, chain.writes)

    async def _wait_indexed(self, request_id: str, writes: list[asyncio.Task[int]]) -> None:
        deadline = time.monotonic() + PERSIST_WAIT_S
        done, pending = await asyncio.wait(writes, timeout=PERSIST_WAIT_S)
        for task in pending:  # keep writing in the background; only stop waiting
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        stream_seqs = [t.result() for t in done if not t.cancelled() and t.exception() is None]
        last = max(stream_seqs, default=0)
        if last and not pending:
            try:
                await self.index.wait_applied(last, timeout_s=max(0.01, deadline - time.monotonic()))
            except KvpathError as exc:
                log.warning(
                    "index lag request_id=%s: %s", request_id, exc.message, extra={"request_id": request_id}
                )

    async def close(self) -> None:
        tasks = [*self._tasks, *(w for c in self._chains.values() for w in c.writes)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

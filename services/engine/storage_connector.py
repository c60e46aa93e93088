"""KV connector over the node's storage service: load stored prefixes, persist every block that fills.

Load: before a sequence is scheduled, its stored prefix (the router's index hit, re-hashed here) is read into
the node's DRAM buffer; during the first prefill chunk, layer l of every loaded block is copied into the
paged cache right before layer l computes. Persist: after each step, blocks that became full are exported
into the storage client's staging segment (a memcpy on the loop, so the cache can be freed right after) and
written by a background task; the request's last token waits for those writes to become durable and
indexed, so the next turn of a session hits them. A missing, corrupt or unreachable store is a miss or a
skipped write, counted by reason, never a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from gpu.runner import LayerHook, PrefillSeq
from services.engine import metrics
from services.engine.connector import KvConnector
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared.blocks import BlockLayout
from shared.bus import Bus
from shared.errors import KvpathError
from shared.hashing import fingerprint_seed, next_block_hash
from shared.kvclient import IndexClient, ReadLease, StorageClient

log = logging.getLogger(__name__)

PERSIST_WAIT_S = 2.0  # longest a finished request waits for its blocks to become durable


@dataclass(slots=True)
class _SeqKv:
    lease: ReadLease | None = None
    num_persisted_blocks: int = 0  # leading blocks already in the store (loaded or written)
    last_hash: int = 0
    is_chain_broken: bool = False  # a block could not be written: later ones could never be matched
    writes: list[asyncio.Task[int]] = field(default_factory=list)


class _LoadHook(LayerHook):
    """Copies layer l of loaded prefix blocks into the cache right before layer l computes."""

    def __init__(self, kv: object, loads: list[tuple[list[int], ReadLease]]) -> None:
        self.kv = kv
        self.loads = loads

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        for block_ids, lease in self.loads:
            self.kv.import_layer(block_ids, layer, lease.layer(layer))  # type: ignore[attr-defined]


class StorageConnector(KvConnector):
    def __init__(
        self,
        bus: Bus,
        runner: object,
        *,
        node: int,
        block_size: int,
        load_kv: bool,
        persist_kv: bool,
        engine_id: str = "",
    ) -> None:
        spec = runner.spec  # type: ignore[attr-defined]
        self.kv = runner.kv  # type: ignore[attr-defined]
        self.block_size = block_size
        self.fingerprint = spec.fingerprint(runner.dtype, block_size)  # type: ignore[attr-defined]
        self.seed = fingerprint_seed(self.fingerprint)
        layout = BlockLayout(spec.num_layers, block_size, self.kv.bytes_per_token_layer)
        self.client = StorageClient(bus, node, layout, self.fingerprint, owner_id=engine_id)
        self.index = IndexClient(bus)
        self.load_kv = load_kv
        self.persist_kv = persist_kv
        self.state: dict[str, _SeqKv] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for st in self.state.values():
            for w in st.writes:
                w.cancel()
        await self.client.close()

    # ------------------------------------------------------------------------------------------- load

    async def prepare(self, seq: Sequence) -> None:
        st = self.state.setdefault(seq.request_id, _SeqKv(last_hash=self.seed))
        num_hit = int(seq.kv_plan.get("num_hit_blocks", 0)) if self.load_kv else 0
        # at least one prompt token is computed, to sample the first output token
        num_hit = min(num_hit, (seq.num_prompt_tokens - 1) // self.block_size)
        if num_hit <= 0:
            return
        hashes = self._chain(seq, num_hit)
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
        st.lease = lease
        st.num_persisted_blocks = lease.num_blocks
        st.last_hash = hashes[lease.num_blocks - 1]
        seq.num_hit_tokens = lease.num_blocks * self.block_size
        metrics.KV_LOADED_BLOCKS.inc(lease.num_blocks)

    def _chain(self, seq: Sequence, num_blocks: int) -> list[int]:
        out, parent, bs = [], self.seed, self.block_size
        for i in range(num_blocks):
            parent = next_block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs))
            out.append(parent)
        return out

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        loads = []
        for c in chunks:
            st = self.state.get(c.seq.request_id)
            if c.load_tokens and st is not None and st.lease is not None:
                n = c.load_tokens // self.block_size
                loads.append((c.seq.block_ids[:n], st.lease))
        return _LoadHook(self.kv, loads) if loads else None

    # ---------------------------------------------------------------------------------------- persist

    def after_step(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            st = self.state.get(seq.request_id)
            if st is None:
                continue
            if st.lease is not None and seq.num_cached_tokens:
                self._keep(asyncio.ensure_future(st.lease.release()))  # the prefix is in the cache now
                st.lease = None
            if self.persist_kv:
                self._persist_full_blocks(seq, st)

    def _persist_full_blocks(self, seq: Sequence, st: _SeqKv) -> None:
        full = seq.num_computed_tokens // self.block_size
        start = st.num_persisted_blocks
        if full <= start or st.is_chain_broken:
            return
        try:
            staged = self.client.stage(full - start)
        except KvpathError as exc:
            metrics.KV_PERSIST_FAILURES.labels(exc.code).inc(full - start)
            st.is_chain_broken = True
            return
        self.kv.export_blocks(seq.block_ids[start:full], staged.views)
        hashes, parents, parent, bs = [], [], st.last_hash, self.block_size
        for i in range(start, full):
            parents.append(parent)
            parent = next_block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs))
            hashes.append(parent)
        st.num_persisted_blocks, st.last_hash = full, parent
        st.writes.append(asyncio.create_task(self._write(seq.request_id, staged, hashes, parents)))

    async def _write(self, request_id: str, staged: object, hashes: list[int], parents: list[int]) -> int:
        try:
            result = await self.client.write(staged, hashes, parents, request_id=request_id)  # type: ignore[arg-type]
        except KvpathError as exc:
            metrics.KV_PERSIST_FAILURES.labels(exc.code).inc(len(hashes))
            log.warning("persist failed request_id=%s code=%s: %s", request_id, exc.code, exc.message)
            return 0
        metrics.KV_PERSISTED_BLOCKS.inc(result.num_written)
        return result.event_stream_seq

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        st = self.state.pop(seq.request_id, None)
        if st is None or not st.writes:
            return None
        return self._wait_persisted(seq.request_id, st.writes)

    async def _wait_persisted(self, request_id: str, writes: list[asyncio.Task[int]]) -> None:
        """Until the request's writes are durable and the index has applied them (bounded)."""
        deadline = time.monotonic() + PERSIST_WAIT_S
        done, pending = await asyncio.wait(writes, timeout=PERSIST_WAIT_S)
        for task in pending:  # keep writing in the background; only stop waiting
            self._keep(task)
        stream_seqs = [t.result() for t in done if not t.cancelled() and t.exception() is None]
        last = max(stream_seqs, default=0)
        if last and not pending:
            try:
                await self.index.wait_applied(last, timeout_s=max(0.01, deadline - time.monotonic()))
            except KvpathError as exc:
                log.warning("index lag request_id=%s: %s", request_id, exc.message)

    # ---------------------------------------------------------------------------------------- release

    def release(self, seq: Sequence) -> None:
        st = self.state.get(seq.request_id)
        if st is not None and st.lease is not None:
            self._keep(asyncio.ensure_future(st.lease.release()))
            st.lease = None

    def _keep(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

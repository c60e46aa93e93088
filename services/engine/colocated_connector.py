"""KV connector of a colocated engine: load stored prefixes from its tiers, save every block that fills.

Tiers, fastest first: an upper tier when the engine has one (`KvTier`: the Beluga pool, `pool_tier.py`, or
the remote-memory baseline, `remote_tier.py`), then the node's storage service. Load: before a sequence is
scheduled, the upper tier is asked for the longest prefix it holds (all usable blocks, whatever the index
said) and storage for the rest of the router's index hit; during the first prefill chunk, layer l of every
loaded block is copied into the paged cache right before layer l computes. Save: every block that fills is
written to the upper tier (so blocks read from storage move up) and persisted to storage (`persist.py`); the
request's last token waits until those writes are committed, durable and indexed. A missing, corrupt or
unreachable tier is a miss or a skipped write, counted by reason, never a failed request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpu.runner import LayerHook, PrefillSeq
from services.engine.connector import KvConnector
from services.engine.node_storage import NodeStorage
from services.engine.persist import PersistChain, extend_hashes, root_of
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared.blocks import max_hit_blocks
from shared.bus import Bus
from shared.kvclient import ReadLease
from shared.protocol.tasks import Task


class TierRead(Protocol):
    """Blocks an upper tier holds for one sequence (a lease on them), until they are in the cache."""

    @property
    def num_blocks(self) -> int: ...


class KvTier(Protocol):
    """A KV tier above storage, engine side. Called on the event loop; `read`/`write` may do I/O but never
    block the loop for long; failures are misses (None) or skipped writes, never exceptions."""

    async def read(self, seq: Sequence, num_blocks: int) -> TierRead | None:
        """Lease the longest prefix of the sequence's first `num_blocks` blocks the tier holds."""

    def import_layer(self, block_ids: list[int], read: Any, layer: int) -> None:
        """Copy layer `layer` of the leased blocks into cache blocks `block_ids`."""

    def import_blocks(self, block_ids: list[int], read: Any) -> None:
        """Copy the leased blocks, every layer, into cache blocks `block_ids`."""

    def release(self, read: Any) -> None:
        """End the lease (the blocks are in the cache, or the sequence left)."""

    def write(self, seq: Sequence, start: int, end: int, parent: int) -> Awaitable[None] | None:
        """Copy the sequence's full, hashed blocks [start, end) out of the cache now and store them; the
        awaitable ends once they are published (None: nothing to wait for)."""

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Record:
    """The connector's part of one request (`seq.kv_state`)."""

    pool_read: Any = None  # the prefix read from the upper tier (a TierRead), until it is in the cache
    lease: ReadLease | None = None  # the blocks after it read from storage, until they are in the cache
    num_pool_blocks: int = 0  # leading blocks the pool holds (read from it, or written to it)
    chain: PersistChain = field(default_factory=lambda: PersistChain(0))
    pool_commits: list[Awaitable[None]] = field(default_factory=list)


class LoadHook(LayerHook):
    """Copies the loaded prefix (upper-tier part, then storage part) into the cache: on a GPU layer l right
    before layer l computes (the copies overlap the compute of the layers before); on the CPU, where
    nothing overlaps, every layer before the forward, in the model's worker thread (one thread hop for the
    whole prefill, and the event loop stays free), one copy per run of whole blocks instead of one per run
    per layer. The time spent copying is the request's `import_s`."""

    def __init__(self, connector: ColocatedConnector, loads: list[tuple[Sequence, int]]) -> None:
        self.connector = connector
        self.loads = loads  # (sequence, loaded blocks)
        self.is_layerwise = connector.kv.device != "cpu"

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        if self.is_layerwise:
            self._import(layer)
        elif layer == 0:  # composed with layerwise hooks (route.py): everything before layer 0
            self._import(None)

    def before_forward(self, seqs: Seq[PrefillSeq]) -> None:
        self._import(None)

    def _import(self, layer: int | None) -> None:
        """Layer `layer` of every load (None: every layer)."""
        kv, pool = self.connector.kv, self.connector.pool
        for seq, n in self.loads:
            started = time.perf_counter()
            record: _Record = seq.kv_state
            ids = seq.block_ids[:n]
            pooled = 0
            if record.pool_read is not None and pool is not None:
                if layer is None:
                    pool.import_blocks(ids, record.pool_read)
                else:
                    pool.import_layer(ids, record.pool_read, layer)
                pooled = record.pool_read.num_blocks
            if record.lease is not None:
                if layer is None:
                    kv.import_blocks(ids[pooled:], record.lease.views)
                else:
                    kv.import_layer(ids[pooled:], layer, record.lease.layer(layer))
            seq.timings["import_s"] = seq.timings.get("import_s", 0.0) + time.perf_counter() - started


class ColocatedConnector(KvConnector):
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
        tier: KvTier | None = None,
    ) -> None:
        self.kv = runner.kv
        self.block_size = block_size
        self.storage = NodeStorage(bus, runner, node=node, block_size=block_size, engine_id=engine_id)
        self.persister = self.storage.persister
        self.load_kv = load_kv
        self.persist_kv = persist_kv
        self.pool = tier  # the upper tier (named for the pool, Beluga's)

    async def start(self) -> None:
        await self.storage.start()

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        await self.storage.close()

    supports_choices = True

    def accept(self, seq: Sequence, task: Task) -> None:
        seq.kv_state = _Record()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The choice's blocks so far are its prompt's, persisted (or on their way) by choice 0."""
        record: _Record = parent.kv_state
        child.block_hashes = list(parent.block_hashes)
        child.kv_state = _Record(
            num_pool_blocks=record.num_pool_blocks, chain=PersistChain(record.chain.num_persisted_blocks)
        )

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        if not self.load_kv:
            return
        record: _Record = seq.kv_state
        usable = min(len(seq.block_hashes), max_hit_blocks(seq.num_prompt_tokens, self.block_size))
        if self.pool is not None:
            record.pool_read = await self.pool.read(seq, usable)
        pooled = record.pool_read.num_blocks if record.pool_read is not None else 0
        record.num_pool_blocks = pooled
        lease = await self.storage.read_blocks(seq, pooled, seq.plan.kv.num_hit_blocks)
        stored = lease.num_blocks if lease is not None else 0
        record.lease = lease
        record.chain = PersistChain(pooled + stored)  # those blocks are in storage already
        seq.num_hit_tokens = (pooled + stored) * self.block_size

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        loads = [(c.seq, c.load_tokens // self.block_size) for c in chunks if c.load_tokens]
        loads = [(s, n) for s, n in loads if s.kv_state.pool_read is not None or s.kv_state.lease is not None]
        return LoadHook(self, loads) if loads else None

    # ------------------------------------------------------------------------------------------- save

    def save(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            record: _Record = seq.kv_state
            if seq.num_cached_tokens:
                self._release_reads(record)  # the prefix is in the cache now
            if self.persist_kv:
                self.persister.persist(seq, record.chain)
            if self.pool is not None:
                self._save_to_pool(seq, record)

    def _save_to_pool(self, seq: Sequence, record: _Record) -> None:
        full = seq.num_computed_tokens // self.block_size
        start = record.num_pool_blocks
        if full <= start:
            return
        hashes = extend_hashes(seq, full, self.persister.seed, self.block_size)
        parent = hashes[start - 1] if start else root_of(seq, self.persister.seed)
        assert self.pool is not None
        commit = self.pool.write(seq, start, full, parent)
        record.num_pool_blocks = full
        if commit is not None:
            record.pool_commits.append(commit)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        record: _Record = seq.kv_state
        persisted = self.persister.finish(seq.request_id, record.chain)
        waits = [w for w in (persisted, *record.pool_commits) if w is not None]
        if not waits:
            return None
        return _all(waits)

    def release(self, seq: Sequence) -> None:
        self._release_reads(seq.kv_state)

    def _release_reads(self, record: _Record) -> None:
        read, record.pool_read = record.pool_read, None
        if read is not None and self.pool is not None:
            self.pool.release(read)
        lease, record.lease = record.lease, None
        self.storage.release(lease)


async def _all(waits: list[Awaitable[None]]) -> None:
    for wait in waits:
        await wait

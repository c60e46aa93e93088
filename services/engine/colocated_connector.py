"""KV connector of a colocated engine: load stored prefixes from the node's storage, persist every block.

Load: before a sequence is scheduled, its stored prefix (the router's index hit, under the plan's block
hashes) is read into the node's DRAM buffer; during the first prefill chunk, layer l of every loaded block is
copied into the paged cache right before layer l computes. Persist: every block that fills is written
(`persist.py`), and the request's last token waits until those writes are durable and indexed. A missing,
corrupt or unreachable store is a miss or a skipped write, counted by reason, never a failed request.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from gpu.runner import LayerHook, PrefillSeq
from services.engine.connector import KvConnector
from services.engine.node_storage import NodeStorage
from services.engine.persist import PersistChain
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared.bus import Bus
from shared.kvclient import ReadLease
from shared.protocol.tasks import Task


@dataclass(slots=True)
class _Record:
    """The connector's part of one request (`seq.kv_state`)."""

    lease: ReadLease | None = None  # the loaded prefix, until it is in the cache
    chain: PersistChain = field(default_factory=lambda: PersistChain(0))


class LoadHook(LayerHook):
    """Copies layer l of loaded prefix blocks into the cache right before layer l computes."""

    def __init__(self, kv: Any, loads: list[tuple[list[int], ReadLease]]) -> None:
        self.kv = kv
        self.loads = loads

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        for block_ids, lease in self.loads:
            self.kv.import_layer(block_ids, layer, lease.layer(layer))


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
    ) -> None:
        self.kv = runner.kv
        self.block_size = block_size
        self.storage = NodeStorage(bus, runner, node=node, block_size=block_size, engine_id=engine_id)
        self.persister = self.storage.persister
        self.load_kv = load_kv
        self.persist_kv = persist_kv

    async def start(self) -> None:
        await self.storage.start()

    async def close(self) -> None:
        await self.storage.close()

    def accept(self, seq: Sequence, task: Task) -> None:
        seq.kv_state = _Record()

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        record: _Record = seq.kv_state
        num_hit = seq.plan.kv.num_hit_blocks if self.load_kv else 0
        lease = await self.storage.read_prefix(seq, num_hit)
        if lease is None:
            return
        record.lease = lease
        record.chain = PersistChain(lease.num_blocks)  # those blocks are stored already
        seq.num_hit_tokens = lease.num_blocks * self.block_size

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        loads = []
        for c in chunks:
            lease = c.seq.kv_state.lease
            if c.load_tokens and lease is not None:
                loads.append((c.seq.block_ids[: c.load_tokens // self.block_size], lease))
        return LoadHook(self.kv, loads) if loads else None

    # ---------------------------------------------------------------------------------------- persist

    def save(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            if seq.num_cached_tokens:
                self._release_lease(seq.kv_state)  # the prefix is in the cache now
            if self.persist_kv:
                self.persister.persist(seq, seq.kv_state.chain)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        return self.persister.finish(seq.request_id, seq.kv_state.chain)

    def release(self, seq: Sequence) -> None:
        self._release_lease(seq.kv_state)

    def _release_lease(self, record: _Record) -> None:
        lease, record.lease = record.lease, None
        self.storage.release(lease)

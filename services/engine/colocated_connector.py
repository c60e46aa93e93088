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

from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from gpu.runner import LayerHook
from services.engine.connector import KvConnector
from services.engine.node_storage import NodeStorage
from services.engine.persist import PersistChain
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from services.engine.tiered_prefix import KvTier, PrefixRead, TieredLoadHook, TieredPrefix, TierRead
from shared.blocks import max_hit_blocks
from shared.protocol.tasks import Task

__all__ = ["ColocatedConnector", "KvTier", "TierRead"]


@dataclass(slots=True)
class _Record:
    """The connector's part of one request (`seq.kv_state`)."""

    prefix: PrefixRead = field(default_factory=PrefixRead)  # loaded from the tiers, until in the cache
    num_pool_blocks: int = 0  # leading blocks the pool holds (read from it, or written to it)
    chain: PersistChain = field(default_factory=lambda: PersistChain(0))
    pool_commits: list[Awaitable[None]] = field(default_factory=list)


class ColocatedConnector(KvConnector):
    def __init__(
        self,
        runner: Any,
        storage: NodeStorage,
        *,
        load_kv: bool,
        persist_kv: bool,
        tier: KvTier | None = None,
    ) -> None:
        """`storage`: the link to the node's storage service (this connector starts and closes it)."""
        self.kv = runner.kv
        self.block_size = storage.layout.block_size
        self.storage = storage
        self.persister = self.storage.persister
        self.load_kv = load_kv
        self.persist_kv = persist_kv
        self.pool = tier  # the upper tier (named for the pool, Beluga's)
        self.prefix = TieredPrefix(self.kv, tier, self.storage, self.block_size)

    async def start(self) -> None:
        await self.storage.start()

    async def close(self) -> None:
        await self.prefix.close()
        await self.storage.close()

    supports_choices = True
    reloads_preempted = True

    def accept(self, seq: Sequence, task: Task) -> None:
        seq.kv_state = _Record()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The choice's blocks so far are its prompt's, persisted (or on their way) by choice 0."""
        record: _Record = parent.kv_state
        child.block_hashes = list(parent.block_hashes)
        child.kv_state = _Record(num_pool_blocks=record.num_pool_blocks, chain=record.chain.fork())

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        if not self.load_kv:
            return
        record: _Record = seq.kv_state
        hit = seq.plan.kv.num_hit_blocks
        if seq.num_preemptions:  # what it loaded before, and what it has persisted since
            prefix = await self.prefix.reread(seq, record.chain, hit_blocks=hit)
        else:
            usable = min(len(seq.block_hashes), max_hit_blocks(seq.num_prompt_tokens, self.block_size))
            prefix = await self.prefix.read(seq, tier_blocks=usable, stored_blocks=hit)
        record.prefix = prefix
        record.num_pool_blocks = max(record.num_pool_blocks, prefix.num_tier_blocks)
        if prefix.num_blocks > record.chain.num_persisted_blocks:
            record.chain = PersistChain(prefix.num_blocks)  # those blocks are in storage already
        seq.num_hit_tokens = prefix.num_blocks * self.block_size

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        loads = [
            (c.seq, c.seq.kv_state.prefix, c.load_tokens // self.block_size)
            for c in chunks
            if c.load_tokens and c.seq.kv_state.prefix.num_blocks
        ]
        return TieredLoadHook(self.prefix, loads) if loads else None

    # ------------------------------------------------------------------------------------------- save

    def save(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            record: _Record = seq.kv_state
            if seq.num_computed_tokens:
                self._release_reads(record)  # the prefix is in the cache now
            if self.persist_kv:
                self.persister.persist(seq, record.chain)
            if self.pool is not None:
                self._save_to_pool(seq, record)

    def _save_to_pool(self, seq: Sequence, record: _Record) -> None:
        record.num_pool_blocks, commit = self.prefix.save(seq, record.num_pool_blocks)
        if commit is not None:
            record.pool_commits.append(commit)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        record: _Record = seq.kv_state
        persisted = self.persister.finish(seq, record.chain)
        waits = [w for w in (persisted, *record.pool_commits) if w is not None]
        if not waits:
            return None
        return _all(waits)

    def release(self, seq: Sequence) -> None:
        self._release_reads(seq.kv_state)

    def _release_reads(self, record: _Record) -> None:
        self.prefix.release(record.prefix)


async def _all(waits: list[Awaitable[None]]) -> None:
    for wait in waits:
        await wait

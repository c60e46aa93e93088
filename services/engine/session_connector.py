"""KV connector of a session engine (`--role decode --session-kv`): AMPD's decode worker.

A session is bound to one such engine by the router and every turn of it decodes here; its KV stays resident
in the paged cache between turns (`sessions.py`). Each turn's prefill runs where the router's Algorithm 1
said:
  local   (a `GenerateTask`): the turn takes the session's resident KV, the tokens it still matches, and the
          engine computes the rest itself, in its own prefill queue, chunked into its decode steps; a session
          whose KV is gone (evicted, or first seen here after its engine died) loads its stored prefix from
          the node's storage instead of recomputing it, or, planned with read side `pool`, from the KV pool
          (`--kv-pool`, Beluga) with storage below it (`tiered_prefix.py`);
  remote  (a `DecodeTask`): a prefill engine computes it (`session_remote.py`) and writes back only the
          blocks past the resident ones.
When the turn ends its KV (prompt and output) is kept for the next turn, whatever the finish reason: the
KV of every computed token is valid. Every block that fills is persisted, so an evicted session loads, and
written to the pool when the engine has one (the turn's last token waits for it, as on a colocated engine);
a turn preempted while running (the cache full) reads those blocks back too, and recomputes only the rest.
A request without a session id keeps nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu.runner import LayerHook
from services.engine import metrics
from services.engine.connector import KvConnector
from services.engine.connector_context import ConnectorContext
from services.engine.persist import PersistChain, extend_hashes, root_of
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from services.engine.session_remote import RemoteTurn, RemoteTurns
from services.engine.sessions import (
    ResidentAnnouncer,
    ResidentKv,
    SessionAllocator,
    SessionCache,
    common_prefix,
)
from services.engine.tiered_prefix import PrefixRead, TieredLoadHook, TieredPrefix
from shared.blocks import blocks_for, max_hit_blocks
from shared.protocol.tasks import BufferRef, DecodeTask, GenerateTask, PullHits, PullHitsReply, Task


@dataclass(slots=True)
class SessionRecord:
    """The connector's part of one turn (`seq.kv_state`)."""

    session_id: str
    announced: list[int]  # hbm: hashes announced for the KV this turn took (the next keep diffs them)
    kept_tokens: int = 0  # resident tokens the turn took: valid KV at the head of seq.block_ids
    chain: PersistChain = field(default_factory=lambda: PersistChain(0))
    num_stored_blocks: int = 0  # local turn: stored prefix blocks to read instead of the resident KV
    reads_pool: bool = False  # local turn: the pool first (read side `pool`), storage below it
    prefix: PrefixRead | None = None  # local turn: that stored prefix, until it is in the cache
    remote: RemoteTurn | None = None
    num_pool_blocks: int = 0  # leading blocks the pool holds (read from it, or written to it)
    pool_commits: list[Awaitable[None]] = field(default_factory=list)


class SessionConnector(KvConnector):
    task_type = (GenerateTask, DecodeTask)
    serves_pulls = True
    reloads_preempted = True

    def __init__(
        self, ctx: ConnectorContext, *, persist_kv: bool, area_bytes: int, staging_bytes: int
    ) -> None:
        self.kv = ctx.kv
        self.block_size = ctx.block_size
        self.storage = ctx.node_storage()
        # resident blocks count as free here (SessionAllocator evicts them on demand): one the persister
        # still held would not come back when evicted; the session keeps its KV on this engine anyway
        self.storage.persister.holds_unstaged = False
        self.prefix = TieredPrefix(ctx.kv, ctx.tier, self.storage, ctx.block_size)
        self.persist_kv = persist_kv
        announcer = ResidentAnnouncer(ctx.bus, ctx.engine_id, block_tokens=ctx.block_size)
        self.sessions = SessionCache(ctx.kv, announcer)
        self.remote = RemoteTurns(ctx, self.storage, area_bytes=area_bytes, staging_bytes=staging_bytes)

    async def start(self) -> None:
        await self.storage.start()
        if self.sessions.announcer is not None:
            await self.sessions.announcer.start()

    async def close(self) -> None:
        await self.sessions.close()
        await self.prefix.close()
        await self.storage.close()

    def block_allocator(self, kv: Any) -> SessionAllocator:
        return SessionAllocator(kv, self.sessions)

    # ------------------------------------------------------------------------------------ admission

    def accept(self, seq: Sequence, task: Task) -> BufferRef | None:
        """Take the session's resident KV that the prompt still starts with; a remote turn also reserves the
        buffer its prefill engine writes the rest into (OverloadedError when it is full)."""
        handoff = self.remote.reserve(seq, task) if isinstance(task, DecodeTask) else None
        session = seq.plan.session_id
        entry = self.sessions.take(session) if session else None
        record = SessionRecord(session_id=session, announced=list(entry.block_hashes) if entry else [])
        seq.kv_state = record
        if handoff is not None:
            kept = self._take_resident(seq, entry, whole_blocks=True)
            record.kept_tokens = kept
            kept_blocks = kept // self.block_size
            record.remote = RemoteTurn(handoff=handoff, num_kept_blocks=kept_blocks)
            return self.remote.ref(record.remote)
        kept = self._take_resident(seq, entry, whole_blocks=False)
        stored = seq.plan.kv.num_hit_blocks
        if stored * self.block_size > kept:  # storage (or the pool) holds more than the cache: load it
            self.sessions.release(seq.block_ids)
            seq.block_ids, kept = [], 0
            record.num_stored_blocks = stored
            record.reads_pool = seq.plan.kv.read_side == "pool"
        record.kept_tokens = kept
        seq.num_computed_tokens = seq.num_cached_tokens = kept
        record.chain = PersistChain(kept // self.block_size)  # the resident full blocks are stored
        source = "resident" if kept else ("pool" if record.reads_pool else "storage") if stored else "none"
        metrics.SESSION_PREFIX_SOURCE.labels(source).inc()
        return None

    def _take_resident(self, seq: Sequence, entry: ResidentKv | None, *, whole_blocks: bool) -> int:
        """Give the turn the resident blocks holding the prompt's common prefix with the session's KV (whole
        blocks for a remote turn; a local turn also keeps the partial block and leaves at least one prompt
        token to compute); free the rest. The number of tokens whose KV it took."""
        if entry is None:
            return 0
        common = common_prefix(entry.token_ids, seq.prompt_token_ids)
        if whole_blocks:
            common -= common % self.block_size
            keep = common // self.block_size
        else:
            common = min(common, seq.num_prompt_tokens - 1)
            keep = blocks_for(common, self.block_size)
        seq.block_ids = entry.block_ids[:keep]
        self.sessions.release(entry.block_ids[keep:])
        return common

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        record: SessionRecord = seq.kv_state
        if seq.num_preemptions:  # its blocks stored so far (a remote turn's too): read, not recomputed
            record.prefix = await self.prefix.reread(seq, record.chain)
            record.num_pool_blocks = max(record.num_pool_blocks, record.prefix.num_tier_blocks)
            seq.num_hit_tokens = record.prefix.num_blocks * self.block_size
            return
        if record.remote is not None:
            chain = await self.remote.load(seq, record.remote)
            if chain is not None:
                record.chain = chain
                metrics.SESSION_PREFIX_SOURCE.labels("pe").inc()
            return
        if record.num_stored_blocks:
            usable = max_hit_blocks(seq.num_prompt_tokens, self.block_size) if record.reads_pool else 0
            prefix = await self.prefix.read(seq, tier_blocks=usable, stored_blocks=record.num_stored_blocks)
            record.prefix = prefix
            record.num_pool_blocks = prefix.num_tier_blocks
            seq.num_hit_tokens = prefix.num_blocks * self.block_size
            record.chain = PersistChain(prefix.num_blocks)

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        loads = [
            (c.seq, c.seq.kv_state.prefix, c.load_tokens // self.block_size)
            for c in chunks
            if c.load_tokens and c.seq.kv_state.prefix is not None
        ]
        return TieredLoadHook(self.prefix, loads) if loads else None

    def import_prefilled(self, chunks: Seq[PrefillChunk]) -> None:
        for chunk in chunks:
            turn = chunk.seq.kv_state.remote
            assert turn is not None, "only a remote turn is taken over without compute"
            self.remote.import_blocks(chunk.seq, turn)

    async def serve_pull(self, seq: Sequence, msg: PullHits) -> PullHitsReply:
        record: SessionRecord = seq.kv_state
        if record.remote is None:
            return PullHitsReply(request_id=msg.request_id, num_blocks=0)
        return await self.remote.serve_pull(seq, record.remote, msg)

    # ------------------------------------------------------------------------------------------- save

    def save(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            record: SessionRecord = seq.kv_state
            if record.prefix is not None and seq.num_computed_tokens:
                self.prefix.release(record.prefix)  # the prefix is in the cache now
                record.prefix = None
            if self.persist_kv:
                self.storage.persister.persist(seq, record.chain)
            record.num_pool_blocks, commit = self.prefix.save(seq, record.num_pool_blocks)
            if commit is not None:
                record.pool_commits.append(commit)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        record: SessionRecord = seq.kv_state
        persisted = self.storage.persister.finish(seq, record.chain) if self.persist_kv else None
        announced = self._keep_resident(seq, record)
        waits = [w for w in (persisted, announced, *record.pool_commits) if w is not None]
        return _all(waits) if waits else None

    def _keep_resident(self, seq: Sequence, record: SessionRecord) -> Awaitable[None] | None:
        """Hand the KV of every computed token back to the session cache (the blocks leave the sequence, so
        the scheduler does not free them); announce the change at `hbm:<engine>`."""
        if not record.session_id:
            return None
        valid = seq.num_computed_tokens
        if valid == 0 and seq.num_preemptions == 0:
            valid = record.kept_tokens  # a remote turn that never took over: the resident part still holds
        valid = min(valid, len(seq.block_ids) * self.block_size)
        announcer = self.sessions.announcer
        if valid <= 0:
            if record.announced and announcer is not None:
                return announcer.changed(record.announced, [], [])
            return None
        n_blocks, full = blocks_for(valid, self.block_size), valid // self.block_size
        seed = self.storage.persister.seed
        hashes = extend_hashes(seq, full, seed, self.block_size)[:full]
        entry = ResidentKv(record.session_id, seq.token_ids(0, valid), seq.block_ids[:n_blocks], hashes)
        seq.block_ids = seq.block_ids[n_blocks:]
        if not self.sessions.keep(entry) or announcer is None:
            return None
        same = common_prefix(record.announced, hashes, dtype=np.uint64)
        if same == len(record.announced) == len(hashes):
            return None
        parents = [hashes[same - 1] if same else root_of(seq, seed), *hashes[same:-1]]
        return announcer.changed(record.announced[same:], hashes[same:], parents)

    def release(self, seq: Sequence) -> None:
        record: SessionRecord | None = seq.kv_state
        if record is None:
            return
        self.prefix.release(record.prefix)
        record.prefix = None
        if record.remote is not None:
            self.remote.release(record.remote)
            record.remote = None


async def _all(waits: list[Awaitable[None]]) -> None:
    for wait in waits:
        await wait

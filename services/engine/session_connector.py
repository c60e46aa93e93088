"""KV connector of a session engine (`--role decode --session-kv`): AMPD's decode worker.

A session is bound to one such engine by the router and every turn of it decodes here; its KV stays resident
in the paged cache between turns (`sessions.py`). Each turn's prefill runs where the router's Algorithm 1
said:
  local   (a `GenerateTask`): the turn takes the session's resident KV, the tokens it still matches, and the
          engine computes the rest itself, in its own prefill queue, chunked into its decode steps; a session
          whose KV is gone (evicted, or first seen here after its engine died) loads its stored prefix from
          the node's storage instead of recomputing it;
  remote  (a `DecodeTask`): a prefill engine computes it (`session_remote.py`) and writes back only the
          blocks past the resident ones.
When the turn ends its KV (prompt and output) is kept for the next turn, whatever the finish reason: the
KV of every computed token is valid. Every block that fills is persisted, so an evicted session loads.
A request without a session id keeps nothing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu.runner import LayerHook, PrefillSeq
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
from shared.blocks import blocks_for
from shared.kvclient import ReadLease
from shared.protocol.tasks import BufferRef, DecodeTask, GenerateTask, PullHits, PullHitsReply, Task


@dataclass(slots=True)
class SessionRecord:
    """The connector's part of one turn (`seq.kv_state`)."""

    session_id: str
    announced: list[int]  # hbm: hashes announced for the KV this turn took (the next keep diffs them)
    kept_tokens: int = 0  # resident tokens the turn took: valid KV at the head of seq.block_ids
    chain: PersistChain = field(default_factory=lambda: PersistChain(0))
    num_stored_blocks: int = 0  # local turn: stored prefix blocks to read instead of the resident KV
    lease: ReadLease | None = None  # local turn: that stored prefix, until it is in the cache
    remote: RemoteTurn | None = None


class StoredPrefixHook(LayerHook):
    """Copies a local turn's stored prefix into the cache: every layer before the forward on the CPU, in the
    model's worker thread (nothing to overlap with), layer l before layer l on a GPU."""

    def __init__(self, kv: Any, loads: list[tuple[Sequence, int]]) -> None:
        self.kv = kv
        self.loads = loads
        self.is_layerwise = kv.device != "cpu"

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        if self.is_layerwise:
            self._import(layer)
        elif layer == 0:
            self._import(None)

    def before_forward(self, seqs: Seq[PrefillSeq]) -> None:
        self._import(None)

    def _import(self, layer: int | None) -> None:
        """Layer `layer` of every load (None: every layer)."""
        for seq, n in self.loads:
            started = time.perf_counter()
            lease = seq.kv_state.lease
            if layer is None:
                self.kv.import_blocks(seq.block_ids[:n], lease.views[:n])
            else:
                self.kv.import_layer(seq.block_ids[:n], layer, lease.layer(layer))
            seq.timings["import_s"] = seq.timings.get("import_s", 0.0) + time.perf_counter() - started


class SessionConnector(KvConnector):
    task_type = (GenerateTask, DecodeTask)
    serves_pulls = True

    def __init__(
        self, ctx: ConnectorContext, *, persist_kv: bool, area_bytes: int, staging_bytes: int
    ) -> None:
        self.kv = ctx.kv
        self.block_size = ctx.block_size
        self.storage = ctx.node_storage()
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
        if stored * self.block_size > kept:  # storage holds more than the cache: load it instead
            self.sessions.release(seq.block_ids)
            seq.block_ids, kept = [], 0
            record.num_stored_blocks = stored
        record.kept_tokens = kept
        seq.num_computed_tokens = seq.num_cached_tokens = kept
        record.chain = PersistChain(kept // self.block_size)  # the resident full blocks are stored
        metrics.SESSION_PREFIX_SOURCE.labels("resident" if kept else "storage" if stored else "none").inc()
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
        if record.remote is not None:
            chain = await self.remote.load(seq, record.remote)
            if chain is not None:
                record.chain = chain
                metrics.SESSION_PREFIX_SOURCE.labels("pe").inc()
            return
        if record.num_stored_blocks:
            lease = await self.storage.read_blocks(seq, 0, record.num_stored_blocks)
            record.lease = lease
            loaded = lease.num_blocks if lease is not None else 0
            seq.num_hit_tokens = loaded * self.block_size
            record.chain = PersistChain(loaded)

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        loads = [
            (c.seq, c.load_tokens // self.block_size)
            for c in chunks
            if c.load_tokens and c.seq.kv_state.lease is not None
        ]
        return StoredPrefixHook(self.kv, loads) if loads else None

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
            if record.lease is not None and seq.num_cached_tokens:
                self.storage.release(record.lease)  # the prefix is in the cache now
                record.lease = None
            if self.persist_kv:
                self.storage.persister.persist(seq, record.chain)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        record: SessionRecord = seq.kv_state
        persisted = self.storage.persister.finish(seq.request_id, record.chain) if self.persist_kv else None
        announced = self._keep_resident(seq, record)
        waits = [w for w in (persisted, announced) if w is not None]
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
        if record.lease is not None:
            self.storage.release(record.lease)
            record.lease = None
        if record.remote is not None:
            self.remote.release(record.remote)
            record.remote = None


async def _all(waits: list[Awaitable[None]]) -> None:
    for wait in waits:
        await wait

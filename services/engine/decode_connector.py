"""DE side of DualPath: the DE buffer, the DE read path, the takeover of a prefilled prompt, persistence.

On a `DecodeTask` the DE reserves its buffer (the prompt's Full Blocks) and, when it is the read side,
starts reading the stored prefix into its node's DRAM buffer. A `PullHits` from the PE is answered once that
read is done; the prefix's Layer Blocks are then streamed into the PE's receive area, one notice per layer
(brief §3.4). The sequence is scheduled once the PE's DONE notice (`PrefillDone`) says the buffer holds the
whole prompt KV (§3.5): a load-only chunk copies it into the paged cache (prefix from the node buffer, the
rest from the DE buffer), the buffer is freed, and decoding starts from the PE's first token. Every block
that fills is persisted (`persist.py`). A sequence preempted here (the cache full) reads back from storage
the blocks stored of it (its hit and what this engine persisted) and recomputes only the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from gpu.runner import LayerHook
from services.engine.connector import KvConnector
from services.engine.connector_context import ConnectorContext
from services.engine.handoff import DeBuffer, Handoff, take_over
from services.engine.pe_stream import PeStreams
from services.engine.persist import PersistChain
from services.engine.receive_area import tag
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import SeqStatus, Sequence
from services.engine.tiered_prefix import PrefixRead, TieredLoadHook, TieredPrefix
from shared.errors import InvalidRequestError, KvpathError
from shared.kvclient import ReadLease
from shared.protocol.tasks import BufferRef, DecodeTask, PullHits, PullHitsReply, Task
from shared.transport import Peer


@dataclass(slots=True)
class DeRecord:
    """The connector's part of one request (`seq.kv_state`)."""

    handoff: Handoff  # the prompt's extent of the DE buffer
    read: asyncio.Task[ReadLease | None] | None = None  # DE path: the prefix read into the node buffer
    stream: asyncio.Task[None] | None = None  # DE path: the prefix streaming to the PE
    num_loaded_blocks: int = 0
    chain: PersistChain = field(default_factory=lambda: PersistChain(0))
    reload: PrefixRead | None = None  # after a preemption: the stored blocks read back, until in the cache
    is_choice: bool = (
        False  # a choice forked from the request's choice 0: the extent and read are not its own
    )


class DecodeConnector(KvConnector):
    task_type = DecodeTask
    serves_pulls = True
    supports_choices = True  # n > 1: choice 0's imported prompt is forked (services/engine/choices.py)
    reloads_preempted = True

    def __init__(self, ctx: ConnectorContext, *, persist_kv: bool, area_bytes: int) -> None:
        self.kv = ctx.kv
        self.block_size = ctx.block_size
        self.timeout_s = ctx.transfer_timeout_s
        self.storage = ctx.node_storage()
        self.persist_kv = persist_kv
        self.buffer = DeBuffer(ctx, self.storage, area_bytes)
        self.streams = PeStreams(ctx, self.storage.layout)
        self.prefix = TieredPrefix(self.kv, None, self.storage, self.block_size)  # reloads, storage only

    async def start(self) -> None:
        await self.storage.start()

    async def close(self) -> None:
        await self.storage.close()

    # ------------------------------------------------------------------------------------ admission

    def accept(self, seq: Sequence, task: Task) -> BufferRef:
        """Reserve the DE buffer for the prompt; start the DE-side read. OverloadedError when full."""
        assert isinstance(task, DecodeTask)  # the engine subscribes with `task_type`
        record = DeRecord(self.buffer.reserve(seq, task.pe_id))
        kv = seq.plan.kv
        if kv.read_side == "de" and kv.num_hit_blocks > 0:
            record.read = asyncio.create_task(self.storage.read_prefix(seq, kv.num_hit_blocks))
        seq.kv_state = record
        return self.buffer.ref(record.handoff)

    async def serve_pull(self, seq: Sequence, msg: PullHits) -> PullHitsReply:
        record: DeRecord = seq.kv_state
        if record.read is None:
            raise InvalidRequestError(f"no DE-side read for request {msg.request_id}", param="request_id")
        started = time.monotonic()
        lease = await record.read
        if lease is None:  # the read side failed: the request fails rather than silently recomputing
            node = self.storage.node
            raise KvpathError(f"DE node {node} could not read the stored prefix", code="storage_error")
        n = min(lease.num_blocks, msg.pe_buffer.num_blocks)
        record.num_loaded_blocks = n
        if n:
            record.stream = asyncio.create_task(self._stream(msg.request_id, lease, n, msg.pe_buffer))
        return PullHitsReply(request_id=msg.request_id, num_blocks=n, read_s=time.monotonic() - started)

    async def _stream(self, request_id: str, lease: ReadLease, n: int, pe: BufferRef) -> None:
        """Layer Blocks of the prefix (node buffer) -> the PE's receive area, one write per layer."""
        full_block_bytes = self.storage.layout.full_block_bytes

        async def write_layer(peer: Peer, layer: int, base: int) -> None:
            pieces = [(base + i * full_block_bytes, lease.views[i, layer]) for i in range(n)]
            await peer.write_many(pe.region, pieces, tag=tag(pe.slot, layer), timeout_s=self.timeout_s)

        await self.streams.send(request_id, pe, n, write_layer, path="de_to_pe", what="prefix")

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        """Wait until the PE says the prompt KV is complete; then the sequence takes over from the PE.
        After a preemption: read back what is stored of the sequence instead."""
        record: DeRecord = seq.kv_state
        if seq.num_preemptions:
            await self._reload(seq, record)
            return
        done = await self.buffer.wait_done(seq, record.handoff)
        if done is None:
            return
        if done.finish_reason:
            seq.finish_reason = done.finish_reason  # the PE finished the request already
            if all(c.status is SeqStatus.FINISHED for c in seq.pending_choices):
                return  # else the prompt is still imported, for the other choices
        if record.read is not None:
            await record.read  # DE path: the prefix in the node buffer is ours to import
        else:
            record.num_loaded_blocks = done.num_loaded_blocks
        take_over(seq, done)
        record.chain = PersistChain(record.num_loaded_blocks)  # those blocks are stored already

    async def _reload(self, seq: Sequence, record: DeRecord) -> None:
        """The leading blocks stored of a preempted sequence (once this engine's writes of them ended),
        leased for the first chunk of its recompute (`layer_hook`)."""
        self.prefix.release(record.reload)
        record.reload = await self.prefix.reread(seq, record.chain)
        seq.num_hit_tokens = record.reload.num_blocks * self.block_size

    # ------------------------------------------------------------------------------------------ import

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The choice's prompt blocks are choice 0's: imported and persisted (or on their way) for it."""
        record: DeRecord = parent.kv_state
        child.block_hashes = list(parent.block_hashes)
        persisted = record.chain.fork()
        handoff = Handoff(record.handoff.pe_id, record.handoff.extent, is_done=True)
        child.kv_state = DeRecord(handoff, chain=persisted, is_choice=True)

    def import_prefilled(self, chunks: Seq[PrefillChunk]) -> None:
        """Copy each taken-over prompt's KV into the cache (prefix: node buffer; the rest: DE buffer)."""
        for chunk in chunks:
            seq = chunk.seq
            record: DeRecord = seq.kv_state
            h = record.num_loaded_blocks if record.read is not None else 0
            if h:
                lease = record.read.result() if record.read is not None and record.read.done() else None
                assert lease is not None, "DE-path prefix read must be complete before the takeover"
                self.kv.import_blocks(seq.block_ids[:h], lease.views[:h])
            self.buffer.import_blocks(seq, record.handoff, h)
            self._release_read(record)
            seq.num_cached_tokens = record.num_loaded_blocks * self.block_size

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        """A preempted sequence's recompute: its reloaded blocks into the cache before the chunk computes."""
        loads = []
        for c in chunks:
            read = c.seq.kv_state.reload
            if c.load_tokens and read is not None and read.num_blocks:
                loads.append((c.seq, read, c.load_tokens // self.block_size))
        return TieredLoadHook(self.prefix, loads) if loads else None

    def save(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            record: DeRecord = seq.kv_state
            if record.reload is not None and seq.num_computed_tokens:
                self.prefix.release(record.reload)  # in the cache now
                record.reload = None
            if self.persist_kv:
                self.storage.persister.persist(seq, record.chain)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        return self.storage.persister.finish(seq, seq.kv_state.chain)

    # ----------------------------------------------------------------------------------------- release

    def release(self, seq: Sequence) -> None:
        record: DeRecord = seq.kv_state
        self.prefix.release(record.reload)
        record.reload = None
        if record.is_choice:
            return
        # the PE may still write into the extent: it is freed (and the read released) once it is done or gone
        self.buffer.release(record.handoff, then=lambda: self._release_read(record))

    def _release_read(self, record: DeRecord) -> None:
        read, record.read = record.read, None
        if read is None:
            return

        async def release_after_stream() -> None:
            if record.stream is not None:
                await asyncio.gather(record.stream, return_exceptions=True)
            lease = await read
            if lease is not None:
                await lease.release()

        self.storage.keep(release_after_stream())

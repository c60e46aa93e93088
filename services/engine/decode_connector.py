"""DE side of DualPath: the DE buffer, the DE read path, the takeover of a prefilled prompt, persistence.

On a `DecodeTask` the DE reserves its buffer (the prompt's Full Blocks) and, when it is the read side,
starts reading the stored prefix into its node's DRAM buffer. A `PullHits` from the PE is answered once that
read is done; the prefix's Layer Blocks are then streamed into the PE's receive area, one notice per layer
(brief §3.4). The sequence is scheduled once the PE's DONE notice (`PrefillDone`) says the buffer holds the
whole prompt KV (§3.5): a load-only chunk copies it into the paged cache (prefix from the node buffer, the
rest from the DE buffer), the buffer is freed, and decoding starts from the PE's first token. Every block
that fills is persisted (`persist.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from gpu.runner import LayerHook
from gpu.sampling import GREEDY_BELOW
from services.engine import metrics
from services.engine.connector import KvConnector
from services.engine.node_storage import NodeStorage
from services.engine.peers import PeerPool
from services.engine.persist import PersistChain
from services.engine.receive_area import DONE_LAYER, Extent, ReceiveArea, tag
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import SeqStatus, Sequence
from shared import telemetry
from shared.blocks import blocks_for
from shared.bus import Bus
from shared.errors import InvalidRequestError, KvpathError, ProtocolError
from shared.kvclient import ReadLease
from shared.protocol import decode, encode
from shared.protocol.tasks import (
    BufferRef,
    DecodeTask,
    HitStreamFailed,
    PrefillDone,
    PullHits,
    PullHitsReply,
    Task,
)
from shared.transport import KvReceiver

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0  # an abandoned buffer extent waits this long for its writer at most


@dataclass(slots=True)
class DeRecord:
    """The connector's part of one request (`seq.kv_state`)."""

    pe_id: str
    extent: Extent
    read: asyncio.Task[ReadLease | None] | None = None  # DE path: the prefix read into the node buffer
    stream: asyncio.Task[None] | None = None  # DE path: the prefix streaming to the PE
    num_loaded_blocks: int = 0
    is_done: bool = False  # the PE's DONE notice arrived: nobody writes into the extent any more
    chain: PersistChain = field(default_factory=lambda: PersistChain(0))
    is_choice: bool = (
        False  # a choice forked from the request's choice 0: the extent and read are not its own
    )


class DecodeConnector(KvConnector):
    task_type = DecodeTask
    serves_pulls = True
    supports_choices = True  # n > 1: choice 0's imported prompt is forked (services/engine/choices.py)

    def __init__(
        self,
        bus: Bus,
        runner: Any,
        *,
        engine_id: str,
        node: int,
        block_size: int,
        persist_kv: bool,
        receiver: KvReceiver,
        peers: PeerPool,
        area_bytes: int,
        transfer_timeout_s: float,
    ) -> None:
        self.kv = runner.kv
        self.block_size = block_size
        self.num_layers = runner.spec.num_layers
        self.storage = NodeStorage(bus, runner, node=node, block_size=block_size, engine_id=engine_id)
        self.layout = self.storage.layout
        self.persister = self.storage.persister
        self.persist_kv = persist_kv
        self.receiver = receiver
        self.peers = peers
        self.timeout_s = transfer_timeout_s
        self.area = ReceiveArea(receiver, "de_buffer", area_bytes, self.layout, engine_id)

    async def start(self) -> None:
        await self.storage.start()

    async def close(self) -> None:
        await self.storage.close()

    # ------------------------------------------------------------------------------------ admission

    def accept(self, seq: Sequence, task: Task) -> BufferRef:
        """Reserve the DE buffer for the prompt; start the DE-side read. OverloadedError when full."""
        assert isinstance(task, DecodeTask)  # the engine subscribes with `task_type`
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        n_blocks = blocks_for(seq.num_prompt_tokens, self.block_size)
        extent = self.area.reserve(seq.request_id, n_blocks, ttl_s=remaining + DRAIN_GRACE_S)
        record = DeRecord(pe_id=task.pe_id, extent=extent)
        kv = seq.plan.kv
        if kv.read_side == "de" and kv.num_hit_blocks > 0:
            record.read = asyncio.create_task(self.storage.read_prefix(seq, kv.num_hit_blocks))
        seq.kv_state = record
        return self.area.ref(extent, self.receiver.endpoint())

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
            record.stream = asyncio.create_task(self._traced_stream(msg.request_id, lease, n, msg.pe_buffer))
        return PullHitsReply(request_id=msg.request_id, num_blocks=n, read_s=time.monotonic() - started)

    async def _traced_stream(self, request_id: str, lease: ReadLease, n: int, pe: BufferRef) -> None:
        """`_stream` in a `kv.transfer` span (DE -> PE; a child of the PE's pull) while tracing is on."""
        if not telemetry.tracing_enabled():
            return await self._stream(lease, n, pe)
        attributes = {
            "request_id": request_id,
            "path": "de_to_pe",
            "peer": pe.engine_id,
            "num_blocks": n,
            "bytes": n * self.layout.full_block_bytes,
        }
        with telemetry.span("kv.transfer", attributes=attributes):
            return await self._stream(lease, n, pe)

    async def _stream(self, lease: ReadLease, n: int, pe: BufferRef) -> None:
        """Layer Blocks of the prefix -> the PE's receive area, layer by layer, one notice per layer."""
        layout = self.layout
        layer = 0
        try:
            peer = await self.peers.get(pe, timeout_s=self.timeout_s)
            for layer in range(self.num_layers):
                base = pe.offset + layer * layout.layer_block_bytes
                pieces = [(base + i * layout.full_block_bytes, lease.views[i, layer]) for i in range(n)]
                await peer.write_many(pe.region, pieces, tag=tag(pe.slot, layer), timeout_s=self.timeout_s)
            metrics.TRANSFER_BYTES.labels("de_to_pe").inc(n * layout.full_block_bytes)
        except KvpathError as exc:
            log.warning("prefix stream to %s failed at layer %d: %s", pe.engine_id, layer, exc.message)
            telemetry.set_current_error(f"failed at layer {layer}: {exc.message}")
            await self._fail_stream(pe, layer, exc.message)

    async def _fail_stream(self, pe: BufferRef, from_layer: int, reason: str) -> None:
        meta = encode(HitStreamFailed(error=reason))
        try:
            peer = await self.peers.get(pe, timeout_s=self.timeout_s)
            for layer in range(from_layer, self.num_layers):
                await peer.notify(pe.region, tag(pe.slot, layer), meta, timeout_s=self.timeout_s)
        except KvpathError:
            pass  # the PE is gone or its waits time out

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        """Wait until the PE says the prompt KV is complete; then the sequence takes over from the PE."""
        record: DeRecord = seq.kv_state
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        try:
            meta = await self.area.wait(record.extent, DONE_LAYER, timeout_s=remaining, peer_id=record.pe_id)
            done = decode(meta, PrefillDone)
        except ProtocolError as exc:
            record.is_done = True
            seq.error_code, seq.error_message = "engine_failed", f"malformed DONE from {record.pe_id}: {exc}"
            return
        except KvpathError as exc:
            seq.error_code, seq.error_message = exc.code, f"prefill engine {record.pe_id}: {exc.message}"
            return
        record.is_done = True
        if done.error or done.first_token is None:
            seq.error_code = "engine_failed"
            seq.error_message = f"prefill on {record.pe_id} failed: {done.error or 'no first token'}"
            return
        if done.finish_reason:
            seq.finish_reason = done.finish_reason  # the PE finished the request already
            if all(c.status is SeqStatus.FINISHED for c in seq.pending_choices):
                return  # else the prompt is still imported, for the other choices
        if record.read is not None:
            await record.read  # DE path: the prefix in the node buffer is ours to import
        else:
            record.num_loaded_blocks = done.num_loaded_blocks
        self._take_over(seq, record, done.first_token)

    def _take_over(self, seq: Sequence, record: DeRecord, first_token: int) -> None:
        seq.output_token_ids = [first_token]
        seq.next_delta_seq = 1  # delta 0 (the first token) came from the PE
        seq.num_hit_tokens = seq.num_prompt_tokens
        if seq.rng is not None and seq.sampling.temperature >= GREEDY_BELOW:
            seq.rng.random()  # the PE drew the first token's number: continue the request's sequence
        record.chain = PersistChain(record.num_loaded_blocks)  # those blocks are stored already

    # ------------------------------------------------------------------------------------------ import

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The choice's prompt blocks are choice 0's: imported and persisted (or on their way) for it."""
        record: DeRecord = parent.kv_state
        child.block_hashes = list(parent.block_hashes)
        persisted = PersistChain(record.chain.num_persisted_blocks)
        child.kv_state = DeRecord(record.pe_id, record.extent, is_done=True, chain=persisted, is_choice=True)

    def import_prefilled(self, chunks: Seq[PrefillChunk]) -> None:
        """Copy each taken-over prompt's KV into the cache (prefix: node buffer; the rest: DE buffer)."""
        for chunk in chunks:
            seq = chunk.seq
            record: DeRecord = seq.kv_state
            n = blocks_for(seq.num_prompt_tokens, self.block_size)
            h = record.num_loaded_blocks if record.read is not None else 0
            if h:
                lease = record.read.result() if record.read is not None and record.read.done() else None
                assert lease is not None, "DE-path prefix read must be complete before the takeover"
                self.kv.import_blocks(seq.block_ids[:h], lease.views[:h])
            self.kv.import_blocks(seq.block_ids[h:n], self.area.blocks(record.extent, h, n - h))
            self.area.free(record.extent)
            self._release_read(record)
            seq.num_cached_tokens = record.num_loaded_blocks * self.block_size

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        return None  # a DE recomputes (after preemption) without external KV

    def save(self, seqs: Seq[Sequence]) -> None:
        if self.persist_kv:
            for seq in seqs:
                self.persister.persist(seq, seq.kv_state.chain)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        return self.persister.finish(seq.request_id, seq.kv_state.chain)

    # ----------------------------------------------------------------------------------------- release

    def release(self, seq: Sequence) -> None:
        record: DeRecord = seq.kv_state
        if record.is_choice:
            return
        if record.is_done:
            self.area.free(record.extent)
            self._release_read(record)
        else:  # the PE may still write into the extent: free it only once it is done or gone
            self.storage.keep(self._drain(record))

    async def _drain(self, record: DeRecord) -> None:
        timeout = max(0.01, record.extent.expires_at - time.monotonic())
        try:
            await self.area.wait(record.extent, DONE_LAYER, timeout_s=timeout, peer_id=record.pe_id)
        except KvpathError:
            pass  # the PE died or never answered: nothing writes into the extent any more
        record.is_done = True
        self.area.free(record.extent)
        self._release_read(record)

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

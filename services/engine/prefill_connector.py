"""PE side of DualPath: get the stored prefix (own node, or streamed from the DE), stream KV to the DE.

Read side PE (brief §3.3): the prefix is read from the PE node's storage into its DRAM buffer before the
request is batched; layer l of it is copied into the cache right before layer l computes (the Basic
baseline copies every layer before layer 0). Read side DE (§3.4): the PE reserves a receive area, asks the
DE to stream the prefix there (`PullHits`) and, before layer l, waits for that layer's notice. After layer l
the KV the DE needs (hit + miss on the PE path, miss only on the DE path) goes to the DE buffer; the last
layer's writes are awaited before the step ends, so the cache blocks can be freed after it. The DONE notice
(first token, loaded prefix) follows when the request leaves the PE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from gpu.runner import LayerHook, PrefillSeq
from services.engine import metrics
from services.engine.connector import KvConnector
from services.engine.disagg import DONE_LAYER, Extent, PeerPool, ReceiveArea, decode_meta, encode_meta, tag
from services.engine.persist import BlockPersister
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared import telemetry
from shared.blocks import BlockLayout, ExtentAllocator, full_blocks_view, layer_view
from shared.bus import Bus
from shared.errors import DeadlineExceededError, KvpathError, OverloadedError, TransportError
from shared.kvclient import IndexClient, ReadLease, StorageClient
from shared.protocol.disagg import BufferRef, PrefillTask, PullHits, PullHitsReply
from shared.transport import KvReceiver

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _PeSeq:
    task: PrefillTask
    num_loaded_blocks: int = 0
    lease: ReadLease | None = None  # PE path
    pull: Extent | None = None  # DE path: where the DE streams the prefix
    num_pulled_layers: int = 0  # layer notices consumed: the DE writes nothing more once all are
    staging: int = -1  # offset of this request's Full Blocks in the staging buffer
    error: KvpathError | None = None
    layer_s: list[float] = field(default_factory=list)


class PrefillConnector(KvConnector):
    def __init__(
        self,
        bus: Bus,
        runner: object,
        *,
        engine_id: str,
        node: int,
        block_size: int,
        receiver: KvReceiver,
        peers: PeerPool,
        area_bytes: int,
        staging_bytes: int,
        transfer_timeout_s: float,
    ) -> None:
        spec = runner.spec  # type: ignore[attr-defined]
        self.kv = runner.kv  # type: ignore[attr-defined]
        self.bus = bus
        self.engine_id = engine_id
        self.block_size = block_size
        self.num_layers = spec.num_layers
        self.layout = BlockLayout(spec.num_layers, block_size, self.kv.bytes_per_token_layer)
        fingerprint = spec.fingerprint(runner.dtype, block_size)  # type: ignore[attr-defined]
        self.storage = StorageClient(bus, node, self.layout, fingerprint, owner_id=engine_id)
        # a request whose first token ends it never reaches a DE: the PE persists its prompt itself
        self.persister = BlockPersister(self.storage, IndexClient(bus), self.kv, block_size)
        self.receiver = receiver
        self.area = ReceiveArea(receiver, "pe_recv", area_bytes, self.layout, engine_id)
        self.peers = peers
        self.staging = np.empty(staging_bytes, dtype=np.uint8)
        self._staging_alloc = ExtentAllocator(staging_bytes)
        self.timeout_s = transfer_timeout_s
        self.state: dict[str, _PeSeq] = {}
        self._tasks: set[asyncio.Future[object]] = set()

    def bind(self, seq: Sequence, task: PrefillTask) -> None:
        """Attach the router's task and reserve staging for the KV sent to the DE (on admission, before
        `prepare`); OverloadedError when the staging buffer is full."""
        n_blocks = -(-seq.num_prompt_tokens // self.block_size)
        offset = self._staging_alloc.allocate(self.layout.blocks_bytes(n_blocks))
        if offset is None:
            raise OverloadedError(f"PE staging buffer full ({n_blocks} blocks wanted)")
        self.state[seq.request_id] = _PeSeq(task=task, staging=offset)

    async def start(self) -> None:
        await self.storage.start()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.persister.close()
        await self.storage.close()

    # --------------------------------------------------------------------------------------- prepare

    async def prepare(self, seq: Sequence) -> None:
        st = self.state[seq.request_id]
        hits = min(st.task.num_hit_blocks, (seq.num_prompt_tokens - 1) // self.block_size)
        if hits <= 0 or not st.task.read_side:
            return
        started = time.monotonic()
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        try:
            if st.task.read_side == "pe":
                hashes = self.persister.chain(seq, hits)
                lease = await self.storage.read(seq.request_id, hashes, deadline_s=remaining)
                st.lease, st.num_loaded_blocks = lease, lease.num_blocks
            else:
                st.num_loaded_blocks = await self._pull(seq, st, hits, remaining)
        except KvpathError as exc:  # the read side cannot deliver: recompute the prefix (a miss)
            if isinstance(exc, DeadlineExceededError):
                st.pull = None  # the DE may still stream into it: the area's reaper frees it at expiry
            metrics.KV_LOAD_MISSES.labels(exc.code).inc(hits)
            log.warning(
                "prefix %s-side read failed request_id=%s: %s", st.task.read_side, seq.request_id, exc.message
            )
            self._drop_prefix(seq.request_id, st)
            st.num_loaded_blocks = 0
        seq.num_hit_tokens = st.num_loaded_blocks * self.block_size
        seq.timings["read_s"] = time.monotonic() - started
        metrics.KV_LOADED_BLOCKS.inc(st.num_loaded_blocks)

    async def _pull(self, seq: Sequence, st: _PeSeq, hits: int, remaining_s: float) -> int:
        st.pull = self.area.reserve(seq.request_id, hits, ttl_s=remaining_s + 30.0)
        ref = self.area.ref(st.pull, self.receiver.endpoint())
        subject = self.bus.subjects.transfer(st.task.de_buffer.engine_id)
        reply = await self.bus.request(
            subject, PullHits(request_id=seq.request_id, pe_buffer=ref), PullHitsReply, timeout_s=remaining_s
        )
        return min(reply.num_blocks, hits)

    # ------------------------------------------------------------------------------------ layer hook

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        return _PrefillHook(self, [(c, self.state[c.seq.request_id]) for c in chunks])

    def staged(self, st: _PeSeq, n_blocks: int) -> np.ndarray:
        return full_blocks_view(self.staging, st.staging, n_blocks, self.layout)

    def after_step(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            st = self.state.get(seq.request_id)
            if st is not None and seq.num_cached_tokens:
                self._drop_prefix(seq.request_id, st)  # the prefix is in the cache now

    def failures(self) -> dict[str, KvpathError]:
        return {rid: st.error for rid, st in self.state.items() if st.error is not None}

    # ------------------------------------------------------------------------------------ hand-off

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        st = self.state.pop(seq.request_id, None)
        if st is None:
            return None
        self._drop_prefix(seq.request_id, st)
        if st.staging >= 0:
            self._staging_alloc.free(st.staging)
        token = seq.output_token_ids[0] if seq.output_token_ids else None
        ends_here = seq.finish_reason in ("stop", "length")  # else handoff (the DE decodes), abort, error
        persisted = None
        if ends_here:
            self.persister.track(seq, st.num_loaded_blocks)
            self.persister.persist(seq)
            persisted = self.persister.finish(seq.request_id)
        meta = encode_meta(
            first_token=token,
            finish_reason=seq.finish_reason if ends_here else None,
            loaded=st.num_loaded_blocks,
            error=seq.error_message or None,
        )
        return self._notify_done(st.task.de_buffer, meta, persisted)

    async def _notify_done(self, de: BufferRef, meta: bytes, persisted: Awaitable[None] | None) -> None:
        if persisted is not None:
            await persisted
        try:
            peer = await self.peers.get(de, timeout_s=self.timeout_s)
            await peer.notify(de.region, tag(de.slot, DONE_LAYER), meta, timeout_s=self.timeout_s)
        except KvpathError as exc:  # the DE learns from its own deadline or our disconnect
            log.warning("DONE notice failed de=%s: %s", de.engine_id, exc.message)

    def _drop_prefix(self, request_id: str, st: _PeSeq) -> None:
        if st.lease is not None:
            self._keep(asyncio.ensure_future(st.lease.release()))
            st.lease = None
        pull, st.pull = st.pull, None
        if pull is None:
            return
        if st.num_pulled_layers >= self.num_layers or st.num_loaded_blocks == 0:
            self.area.free(request_id)
        else:  # aborted mid-stream: free once the DE's last layer is in (or the DE is gone)
            self._keep(asyncio.ensure_future(self._drain_pull(request_id, pull, st.task.de_buffer.engine_id)))

    async def _drain_pull(self, request_id: str, pull: Extent, de_id: str) -> None:
        timeout = max(0.01, pull.expires_at - time.monotonic())
        try:
            await self.area.wait(pull, self.num_layers - 1, timeout_s=timeout, peer_id=de_id)
        except KvpathError:
            pass  # the DE is gone: nothing writes into the extent any more
        self.area.free(request_id)

    def _keep(self, task: asyncio.Future[object]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _PrefillHook(LayerHook):
    """Loads the prefix layer by layer and streams each computed layer to the DE buffers.

    While tracing is on, each request of the batch gets a `kv.transfer` span (PE -> DE) from the start of
    the forward to its last layer's writes being done, with the bytes sent."""

    def __init__(self, conn: PrefillConnector, items: list[tuple[PrefillChunk, _PeSeq]]) -> None:
        self.conn = conn
        self.items = items
        self.writes: list[tuple[_PeSeq, asyncio.Task[int]]] = []
        self.started = time.monotonic()
        self.spans = [_transfer_span(c, st) for c, st in items] if telemetry.tracing_enabled() else None

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        for chunk, st in self.items:
            n = chunk.load_tokens // self.conn.block_size
            if not n or st.error is not None:
                continue
            ids = chunk.seq.block_ids[:n]
            if st.lease is not None:
                if st.task.is_layerwise:
                    self.conn.kv.import_layer(ids, layer, st.lease.layer(layer))
                elif layer == 0:  # Basic: the whole prefix before compute
                    self.conn.kv.import_blocks(ids, st.lease.views[:n])
            elif st.pull is not None:
                await self._import_pulled(chunk, st, ids, layer)

    async def _import_pulled(self, chunk: PrefillChunk, st: _PeSeq, ids: list[int], layer: int) -> None:
        assert st.pull is not None
        try:
            meta = await self.conn.area.wait(
                st.pull, layer, timeout_s=self.conn.timeout_s, peer_id=st.task.de_buffer.engine_id
            )
        except KvpathError as exc:
            st.error = exc
            return
        st.num_pulled_layers = layer + 1  # this notice is consumed, whatever it says
        error = decode_meta(meta).get("error")
        if error:
            st.error = TransportError(f"prefix stream from {st.task.de_buffer.engine_id} failed: {error}")
            return
        self.conn.kv.import_layer(ids, layer, layer_view(self.conn.area.blocks(st.pull, 0, len(ids)), layer))

    async def after_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        last = layer == self.conn.num_layers - 1
        for chunk, st in self.items:
            if st.error is None and (st.task.is_layerwise or last):
                self.writes.append((st, asyncio.create_task(self._send(chunk, st, layer))))
        if last:
            sent: dict[int, int] = {}
            for st, write in self.writes:
                try:
                    nbytes = await write
                except KvpathError as exc:
                    st.error = st.error or exc
                else:
                    sent[id(st)] = sent.get(id(st), 0) + nbytes
            metrics.TRANSFER_BYTES.labels("pe_to_de").inc(sum(sent.values()))
            metrics.PREFILL_LAYERS.observe((time.monotonic() - self.started) / self.conn.num_layers)
            if self.spans is not None:
                self._end_spans(sent)

    def _end_spans(self, sent: dict[int, int]) -> None:
        assert self.spans is not None
        for (_, st), span in zip(self.items, self.spans, strict=True):
            error = f"{st.error.code}: {st.error.message}" if st.error is not None else ""
            telemetry.end_span(span, error=error, attributes={"bytes": sent.get(id(st), 0)})

    async def _send(self, chunk: PrefillChunk, st: _PeSeq, layer: int) -> int:
        """Layer `layer` (or, for Basic, every layer) of the blocks this chunk touched -> DE buffer."""
        conn, de, bs = self.conn, st.task.de_buffer, self.conn.block_size
        if chunk.load_tokens:  # first chunk: the DE already holds the hits on the DE path
            first = chunk.load_tokens // bs if st.task.read_side == "de" else 0
        else:
            first = chunk.start // bs
        end = -(-(chunk.start + chunk.num_tokens) // bs)
        if end <= first:
            return 0
        ids = chunk.seq.block_ids[first:end]
        staged = conn.staged(st, end)[first:end]
        layers = [layer] if st.task.is_layerwise else range(conn.num_layers)
        pieces = []
        for lyr in layers:
            conn.kv.export_layer(ids, lyr, layer_view(staged, lyr))
            base = de.offset + lyr * conn.layout.layer_block_bytes
            pieces += [
                (base + (first + i) * conn.layout.full_block_bytes, staged[i, lyr])
                for i in range(end - first)
            ]
        peer = await conn.peers.get(de, timeout_s=conn.timeout_s)
        await peer.write_many(de.region, pieces, timeout_s=conn.timeout_s)
        return len(pieces) * conn.layout.layer_block_bytes


def _transfer_span(chunk: PrefillChunk, st: _PeSeq) -> object:
    trace = chunk.seq.trace
    attributes = {
        "request_id": chunk.seq.request_id,
        "path": "pe_to_de",
        "peer": st.task.de_buffer.engine_id,
        "is_layerwise": st.task.is_layerwise,
        "start_token": chunk.start,
        "num_tokens": chunk.num_tokens,
    }
    return telemetry.start_span("kv.transfer", parent=trace.parent if trace else None, attributes=attributes)

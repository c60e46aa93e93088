"""DE side of DualPath: the DE buffer, the DE read path, the takeover of a prefilled prompt.

On a `DecodeTask` the DE reserves its buffer (the prompt's Full Blocks) and, when it is the read side,
starts reading the stored prefix into its node's DRAM buffer. A `PullHits` from the PE is answered once that
read is done; the prefix's Layer Blocks are then streamed into the PE's receive area, one notice per layer
(brief §3.4). The sequence is scheduled once the PE's DONE notice says the buffer holds the whole prompt
KV (§3.5): a load-only chunk copies it into the paged cache (prefix from the node buffer, the rest from the
DE buffer), the buffer is freed, and decoding starts from the PE's first token. Every block that fills is
persisted by the inherited `StorageConnector` logic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from services.engine import metrics
from services.engine.disagg import DONE_LAYER, Extent, PeerPool, ReceiveArea, decode_meta, encode_meta, tag
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from services.engine.storage_connector import StorageConnector
from shared import telemetry
from shared.bus import Bus
from shared.errors import InvalidRequestError, KvpathError
from shared.kvclient import ReadLease
from shared.protocol.disagg import BufferRef, DecodeTask, PullHits, PullHitsReply
from shared.transport import KvReceiver

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0  # an abandoned buffer extent waits this long for its writer at most


@dataclass(slots=True)
class _DeSeq:
    task: DecodeTask
    extent: Extent
    read: asyncio.Task[ReadLease | None] | None = None
    stream: asyncio.Task[None] | None = None
    num_loaded_blocks: int = 0
    is_done: bool = False  # the PE's DONE notice arrived: nobody writes into the extent any more


class DecodeConnector(StorageConnector):
    def __init__(
        self,
        bus: Bus,
        runner: object,
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
        super().__init__(
            bus,
            runner,
            node=node,
            block_size=block_size,
            load_kv=False,
            persist_kv=persist_kv,
            engine_id=engine_id,
        )
        self.receiver = receiver
        self.peers = peers
        self.timeout_s = transfer_timeout_s
        self.num_layers = self.client.layout.num_layers
        self.area = ReceiveArea(receiver, "de_buffer", area_bytes, self.client.layout, engine_id)
        self.de_state: dict[str, _DeSeq] = {}

    # ------------------------------------------------------------------------------------ admission

    def accept(self, seq: Sequence, task: DecodeTask) -> BufferRef:
        """Reserve the DE buffer for the prompt; start the DE-side read. OverloadedError when full."""
        remaining = max(0.01, task.deadline_unix_s - time.time())
        n_blocks = -(-seq.num_prompt_tokens // self.block_size)
        extent = self.area.reserve(seq.request_id, n_blocks, ttl_s=remaining + DRAIN_GRACE_S)
        st = _DeSeq(task=task, extent=extent)
        hits = min(task.num_hit_blocks, (seq.num_prompt_tokens - 1) // self.block_size)
        if task.read_side == "de" and hits > 0:
            st.read = asyncio.create_task(self._read(seq, hits, remaining))
        self.de_state[seq.request_id] = st
        return self.area.ref(extent, self.receiver.endpoint())

    async def _read(self, seq: Sequence, hits: int, remaining_s: float) -> ReadLease | None:
        try:
            return await self.client.read(
                seq.request_id, self.persister.chain(seq, hits), deadline_s=remaining_s
            )
        except KvpathError as exc:
            metrics.KV_LOAD_MISSES.labels(exc.code).inc(hits)
            log.warning("DE read failed request_id=%s: %s", seq.request_id, exc.message)
            return None

    async def serve_pull(self, msg: PullHits) -> PullHitsReply:
        st = self.de_state.get(msg.request_id)
        if st is None or st.read is None:
            raise InvalidRequestError(f"no DE-side read for request {msg.request_id}", param="request_id")
        started = time.monotonic()
        lease = await st.read
        if lease is None:  # the read side failed: the request fails rather than silently recomputing
            raise KvpathError(
                f"DE node {self.client.node} could not read the stored prefix", code="storage_error"
            )
        n = min(lease.num_blocks, msg.pe_buffer.num_blocks)
        st.num_loaded_blocks = n
        if n:
            st.stream = asyncio.create_task(self._traced_stream(msg.request_id, lease, n, msg.pe_buffer))
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
            "bytes": n * self.client.layout.full_block_bytes,
        }
        with telemetry.span("kv.transfer", attributes=attributes):
            return await self._stream(lease, n, pe)

    async def _stream(self, lease: ReadLease, n: int, pe: BufferRef) -> None:
        """Layer Blocks of the prefix -> the PE's receive area, layer by layer, one notice per layer."""
        layout = self.client.layout
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
        meta = encode_meta(error=reason)
        try:
            peer = await self.peers.get(pe, timeout_s=self.timeout_s)
            for layer in range(from_layer, self.num_layers):
                await peer.notify(pe.region, tag(pe.slot, layer), meta, timeout_s=self.timeout_s)
        except KvpathError:
            pass  # the PE is gone or its waits time out

    # ---------------------------------------------------------------------------------------- prepare

    async def prepare(self, seq: Sequence) -> None:
        """Wait until the PE says the prompt KV is complete; then the sequence takes over from the PE."""
        st = self.de_state[seq.request_id]
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        try:
            meta = decode_meta(
                await self.area.wait(st.extent, DONE_LAYER, timeout_s=remaining, peer_id=st.task.pe_id)
            )
        except KvpathError as exc:
            seq.error_code, seq.error_message = exc.code, f"prefill engine {st.task.pe_id}: {exc.message}"
            return
        st.is_done = True
        if meta.get("error") or meta.get("first_token") is None:
            seq.error_code = "engine_failed"
            seq.error_message = f"prefill on {st.task.pe_id} failed: {meta.get('error') or 'no first token'}"
            return
        if meta.get("finish_reason"):
            seq.finish_reason = str(meta["finish_reason"])  # the PE finished the request already
            return
        if st.read is not None:
            await st.read  # DE path: the prefix in the node buffer is ours to import
        else:
            st.num_loaded_blocks = int(meta.get("loaded", 0))
        seq.output_token_ids = [int(meta["first_token"])]
        seq.next_delta_seq = 1  # delta 0 (the first token) came from the PE
        seq.num_hit_tokens = seq.num_prompt_tokens
        self.persister.track(seq, st.num_loaded_blocks)

    # ------------------------------------------------------------------------------------------ import

    def import_only(self, chunks: Seq[PrefillChunk]) -> None:
        """Copy each taken-over prompt's KV into the cache (prefix: node buffer; the rest: DE buffer)."""
        for chunk in chunks:
            seq = chunk.seq
            st = self.de_state[seq.request_id]
            n = -(-seq.num_prompt_tokens // self.block_size)
            h = st.num_loaded_blocks if st.read is not None else 0
            if h:
                lease = st.read.result() if st.read is not None and st.read.done() else None
                assert lease is not None, "DE-path prefix read must be complete before the takeover"
                self.kv.import_blocks(seq.block_ids[:h], lease.views[:h])
            self.kv.import_blocks(seq.block_ids[h:n], self.area.blocks(st.extent, h, n - h))
            self.area.free(seq.request_id)
            self._release_read(st)
            seq.num_cached_tokens = st.num_loaded_blocks * self.block_size

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> None:
        return None  # a DE recomputes (after preemption) without external KV

    # ----------------------------------------------------------------------------------------- release

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        st = self.de_state.pop(seq.request_id, None)
        if st is None:
            return
        if st.is_done:
            self.area.free(seq.request_id)
            self._release_read(st)
        else:  # the PE may still write into the extent: free it only once it is done or gone
            self._keep(asyncio.ensure_future(self._drain(seq.request_id, st)))

    async def _drain(self, request_id: str, st: _DeSeq) -> None:
        timeout = max(0.01, st.extent.expires_at - time.monotonic())
        try:
            await self.area.wait(st.extent, DONE_LAYER, timeout_s=timeout, peer_id=st.task.pe_id)
        except KvpathError:
            pass  # the PE died or never answered: nothing writes into the extent any more
        self.area.free(request_id)
        self._release_read(st)

    def _release_read(self, st: _DeSeq) -> None:
        read, st.read = st.read, None
        if read is None:
            return

        async def release_after_stream() -> None:
            if st.stream is not None:
                await asyncio.gather(st.stream, return_exceptions=True)
            lease = await read
            if lease is not None:
                await lease.release()

        self._keep(asyncio.ensure_future(release_after_stream()))

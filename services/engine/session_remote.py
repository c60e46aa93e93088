"""A session engine's remote turns (AMPD brief §2.3): a prefill engine (PE) prefills the turn, the session's
KV stays here.

On a `DecodeTask` the engine keeps the session's resident full blocks that the new prompt still starts with
(`num_kept_blocks`, named in the buffer it acks) and reserves its DE buffer for the prompt. The PE gets the
history either from storage or from here (`serve_pull`: the kept blocks streamed from the paged cache into
the PE's receive area, one notice per layer, the DualPath DE-path protocol) and writes only the blocks past
the kept ones back (`BufferRef.num_kept_blocks`). Once the PE's DONE notice says they are complete, a
load-only chunk copies them in after the kept blocks (`import_blocks`) and decoding goes on from the PE's
first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu.sampling import GREEDY_BELOW
from services.engine import metrics
from services.engine.node_storage import NodeStorage
from services.engine.peers import PeerPool
from services.engine.persist import PersistChain
from services.engine.receive_area import DONE_LAYER, Extent, ReceiveArea, tag
from services.engine.sequence import Sequence
from shared import telemetry
from shared.blocks import BlockLayout, ExtentAllocator, blocks_for
from shared.errors import InvalidRequestError, KvpathError, ProtocolError
from shared.protocol import decode, encode
from shared.protocol.tasks import BufferRef, DecodeTask, HitStreamFailed, PrefillDone, PullHits, PullHitsReply
from shared.transport import KvReceiver

log = logging.getLogger(__name__)

DRAIN_GRACE_S = 30.0  # an abandoned buffer extent waits this long for its writer at most


@dataclass(slots=True)
class RemoteTurn:
    """A remote turn's part of the connector record: the DE buffer and what the PE said."""

    pe_id: str
    extent: Extent
    num_kept_blocks: int  # leading blocks of the prompt this engine kept from the session's KV
    is_done: bool = False  # the PE's DONE arrived: nobody writes into the extent any more
    num_loaded_blocks: int = 0  # blocks the PE loaded instead of computing (already stored)
    stream: asyncio.Task[None] | None = None  # kept blocks streaming to the PE


class RemoteTurns:
    def __init__(
        self,
        runner: Any,
        storage: NodeStorage,
        *,
        receiver: KvReceiver,
        peers: PeerPool,
        area_bytes: int,
        staging_bytes: int,
        engine_id: str,
        timeout_s: float,
    ) -> None:
        self.kv = runner.kv
        self.num_layers = runner.spec.num_layers
        self.storage = storage
        self.layout: BlockLayout = storage.layout
        self.receiver = receiver
        self.peers = peers
        self.timeout_s = timeout_s
        self.area = ReceiveArea(receiver, "de_buffer", area_bytes, self.layout, engine_id)
        self.staging = np.empty(staging_bytes, dtype=np.uint8)
        self._staging_alloc = ExtentAllocator(staging_bytes)
        peers.sender.register_memory(self.staging)  # rdma: streams from any part of it skip registration

    # ------------------------------------------------------------------------------------ admission

    def reserve(self, seq: Sequence, task: DecodeTask) -> Extent:
        """The DE buffer for the prompt's blocks; OverloadedError when the buffer is full."""
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        n_blocks = blocks_for(seq.num_prompt_tokens, self.layout.block_size)
        return self.area.reserve(seq.request_id, n_blocks, ttl_s=remaining + DRAIN_GRACE_S)

    def ref(self, turn: RemoteTurn) -> BufferRef:
        ref = self.area.ref(turn.extent, self.receiver.endpoint())
        ref.num_kept_blocks = turn.num_kept_blocks
        return ref

    # ------------------------------------------------------------------------------- history to the PE

    async def serve_pull(self, seq: Sequence, turn: RemoteTurn, msg: PullHits) -> PullHitsReply:
        """Stream the kept blocks (as many as the PE's receive area holds) into the PE's receive area."""
        if turn.stream is not None:
            raise InvalidRequestError(f"history of {msg.request_id} already pulled", param="request_id")
        n = min(turn.num_kept_blocks, msg.pe_buffer.num_blocks)
        if n:
            turn.stream = asyncio.create_task(self._traced_stream(seq, n, msg.pe_buffer))
        return PullHitsReply(request_id=msg.request_id, num_blocks=n)

    async def _traced_stream(self, seq: Sequence, n: int, pe: BufferRef) -> None:
        if not telemetry.tracing_enabled():
            return await self._stream(seq.block_ids[:n], pe)
        attributes = {"request_id": seq.request_id, "path": "hbm_to_pe", "peer": pe.engine_id}
        with telemetry.span("kv.transfer", attributes=attributes):
            return await self._stream(seq.block_ids[:n], pe)

    async def _stream(self, block_ids: list[int], pe: BufferRef) -> None:
        """Layer by layer: export the blocks' layer from the cache into staging, write it to the PE (in
        pieces when staging is short), notice the layer."""
        layout, n = self.layout, len(block_ids)
        per = max(1, min(n, self._staging_alloc.capacity_bytes // layout.layer_block_bytes))
        offset = self._staging_alloc.allocate(per * layout.layer_block_bytes)
        if offset is None:  # staging busy with other streams: a buffer of this stream's own
            buffer = np.empty(per * layout.layer_block_bytes, dtype=np.uint8)
        else:
            buffer = self.staging[offset : offset + per * layout.layer_block_bytes]
        staged = buffer.reshape(per, layout.block_size, layout.bytes_per_token_layer)
        layer = 0
        try:
            peer = await self.peers.get(pe, timeout_s=self.timeout_s)
            for layer in range(self.num_layers):
                base = pe.offset + layer * layout.layer_block_bytes
                for first in range(0, n, per):
                    count = min(per, n - first)
                    self.kv.export_layer(block_ids[first : first + count], layer, staged[:count])
                    pieces = [(base + (first + i) * layout.full_block_bytes, staged[i]) for i in range(count)]
                    is_last = first + count == n
                    notice = tag(pe.slot, layer) if is_last else None
                    await peer.write_many(pe.region, pieces, tag=notice, timeout_s=self.timeout_s)
            metrics.TRANSFER_BYTES.labels("hbm_to_pe").inc(n * layout.full_block_bytes)
        except KvpathError as exc:
            log.warning("history stream to %s failed at layer %d: %s", pe.engine_id, layer, exc.message)
            await self._fail_stream(pe, layer, exc.message)
        finally:
            if offset is not None:
                self._staging_alloc.free(offset)

    async def _fail_stream(self, pe: BufferRef, from_layer: int, reason: str) -> None:
        meta = encode(HitStreamFailed(error=reason))
        try:
            peer = await self.peers.get(pe, timeout_s=self.timeout_s)
            for layer in range(from_layer, self.num_layers):
                await peer.notify(pe.region, tag(pe.slot, layer), meta, timeout_s=self.timeout_s)
        except KvpathError:
            pass  # the PE is gone or its waits time out

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence, turn: RemoteTurn) -> PersistChain | None:
        """Wait for the PE's DONE; take the turn over from its first token. The persistence chain of the
        taken-over prompt, or None when the turn ends here (failed, or finished on the PE)."""
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        try:
            meta = await self.area.wait(turn.extent, DONE_LAYER, timeout_s=remaining, peer_id=turn.pe_id)
            done = decode(meta, PrefillDone)
        except ProtocolError as exc:
            turn.is_done = True
            seq.error_code, seq.error_message = "engine_failed", f"malformed DONE from {turn.pe_id}: {exc}"
            return None
        except KvpathError as exc:
            seq.error_code, seq.error_message = exc.code, f"prefill engine {turn.pe_id}: {exc.message}"
            return None
        turn.is_done = True
        if done.error or done.first_token is None:
            seq.error_code = "engine_failed"
            seq.error_message = f"prefill on {turn.pe_id} failed: {done.error or 'no first token'}"
            return None
        if done.finish_reason:
            seq.finish_reason = done.finish_reason  # the PE finished the request already
            return None
        turn.num_loaded_blocks = done.num_loaded_blocks
        seq.output_token_ids = [done.first_token]
        seq.next_delta_seq = 1  # delta 0 (the first token) came from the PE
        seq.num_hit_tokens = seq.num_prompt_tokens  # a load-only chunk: nothing to compute
        if seq.rng is not None and seq.sampling.temperature >= GREEDY_BELOW:
            seq.rng.random()  # the PE drew the first token's number: continue the request's sequence
        return PersistChain(max(turn.num_kept_blocks, done.num_loaded_blocks))  # those are stored already

    def import_blocks(self, seq: Sequence, turn: RemoteTurn) -> None:
        """Copy the PE's blocks (past the kept ones) from the DE buffer into the cache; free the buffer."""
        n = blocks_for(seq.num_prompt_tokens, self.layout.block_size)
        k = min(turn.num_kept_blocks, n)
        self.kv.import_blocks(seq.block_ids[k:n], self.area.blocks(turn.extent, k, n - k))
        self.area.free(turn.extent)

    # ---------------------------------------------------------------------------------------- release

    def release(self, turn: RemoteTurn) -> None:
        if turn.stream is not None and not turn.stream.done():
            turn.stream.cancel()  # the blocks it reads go back to the cache now
        if turn.is_done:
            self.area.free(turn.extent)
        else:  # the PE may still write into the extent: free it only once it is done or gone
            self.storage.keep(self._drain(turn))

    async def _drain(self, turn: RemoteTurn) -> None:
        timeout = max(0.01, turn.extent.expires_at - time.monotonic())
        try:
            await self.area.wait(turn.extent, DONE_LAYER, timeout_s=timeout, peer_id=turn.pe_id)
        except KvpathError:
            pass  # the PE died or never answered: nothing writes into the extent any more
        turn.is_done = True
        self.area.free(turn.extent)

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
from dataclasses import dataclass

import numpy as np

from services.engine.connector_context import ConnectorContext
from services.engine.handoff import DeBuffer, Handoff, take_over
from services.engine.node_storage import NodeStorage
from services.engine.pe_stream import PeStreams
from services.engine.persist import PersistChain
from services.engine.receive_area import tag
from services.engine.sequence import Sequence
from shared.blocks import ExtentAllocator
from shared.errors import InvalidRequestError
from shared.protocol.tasks import BufferRef, DecodeTask, PullHits, PullHitsReply
from shared.transport import Peer


@dataclass(slots=True)
class RemoteTurn:
    """A remote turn's part of the connector record: the DE buffer and what the PE said."""

    handoff: Handoff  # the extent of the DE buffer the PE writes the turn's blocks into
    num_kept_blocks: int  # leading blocks of the prompt this engine kept from the session's KV
    num_loaded_blocks: int = 0  # blocks the PE loaded instead of computing (already stored)
    stream: asyncio.Task[None] | None = None  # kept blocks streaming to the PE


class RemoteTurns:
    def __init__(
        self, ctx: ConnectorContext, storage: NodeStorage, *, area_bytes: int, staging_bytes: int
    ) -> None:
        self.kv = ctx.kv
        self.layout = storage.layout
        self.timeout_s = ctx.transfer_timeout_s
        self.buffer = DeBuffer(ctx, storage, area_bytes)
        self.streams = PeStreams(ctx, self.layout)
        self.staging = np.empty(staging_bytes, dtype=np.uint8)
        self._staging_alloc = ExtentAllocator(staging_bytes)
        # rdma: streams from any part of it skip registration
        ctx.peers.sender.register_memory(self.staging)

    # ------------------------------------------------------------------------------------ admission

    def reserve(self, seq: Sequence, task: DecodeTask) -> Handoff:
        """The DE buffer for the prompt's blocks; OverloadedError when the buffer is full."""
        return self.buffer.reserve(seq, task.pe_id)

    def ref(self, turn: RemoteTurn) -> BufferRef:
        ref = self.buffer.ref(turn.handoff)
        ref.num_kept_blocks = turn.num_kept_blocks
        return ref

    # ------------------------------------------------------------------------------- history to the PE

    async def serve_pull(self, seq: Sequence, turn: RemoteTurn, msg: PullHits) -> PullHitsReply:
        """Stream the kept blocks (as many as the PE's receive area holds) into the PE's receive area."""
        if turn.stream is not None:
            raise InvalidRequestError(f"history of {msg.request_id} already pulled", param="request_id")
        n = min(turn.num_kept_blocks, msg.pe_buffer.num_blocks)
        if n:
            turn.stream = asyncio.create_task(self._stream(seq, n, msg.pe_buffer))
        return PullHitsReply(request_id=msg.request_id, num_blocks=n)

    async def _stream(self, seq: Sequence, n: int, pe: BufferRef) -> None:
        """Layer by layer: export the blocks' layer from the cache into staging, write it to the PE (in
        pieces when staging is short), notice the layer."""
        block_ids, layout = seq.block_ids[:n], self.layout
        per = max(1, min(n, self._staging_alloc.capacity_bytes // layout.layer_block_bytes))
        offset = self._staging_alloc.allocate(per * layout.layer_block_bytes)
        if offset is None:  # staging busy with other streams: a buffer of this stream's own
            buffer = np.empty(per * layout.layer_block_bytes, dtype=np.uint8)
        else:
            buffer = self.staging[offset : offset + per * layout.layer_block_bytes]
        staged = buffer.reshape(per, layout.block_size, layout.bytes_per_token_layer)

        async def write_layer(peer: Peer, layer: int, base: int) -> None:
            for first in range(0, n, per):
                count = min(per, n - first)
                self.kv.export_layer(block_ids[first : first + count], layer, staged[:count])
                pieces = [(base + (first + i) * layout.full_block_bytes, staged[i]) for i in range(count)]
                notice = tag(pe.slot, layer) if first + count == n else None
                await peer.write_many(pe.region, pieces, tag=notice, timeout_s=self.timeout_s)

        try:
            await self.streams.send(seq.request_id, pe, n, write_layer, path="hbm_to_pe", what="history")
        finally:
            if offset is not None:
                self._staging_alloc.free(offset)

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence, turn: RemoteTurn) -> PersistChain | None:
        """Wait for the PE's DONE; take the turn over from its first token. The persistence chain of the
        taken-over prompt, or None when the turn ends here (failed, or finished on the PE)."""
        done = await self.buffer.wait_done(seq, turn.handoff)
        if done is None:
            return None
        if done.finish_reason:
            seq.finish_reason = done.finish_reason  # the PE finished the request already
            return None
        turn.num_loaded_blocks = done.num_loaded_blocks
        take_over(seq, done)
        return PersistChain(max(turn.num_kept_blocks, done.num_loaded_blocks))  # those are stored already

    def import_blocks(self, seq: Sequence, turn: RemoteTurn) -> None:
        """Copy the PE's blocks (past the kept ones) from the DE buffer into the cache; free the buffer."""
        self.buffer.import_blocks(seq, turn.handoff, turn.num_kept_blocks)

    # ---------------------------------------------------------------------------------------- release

    def release(self, turn: RemoteTurn) -> None:
        if turn.stream is not None and not turn.stream.done():
            turn.stream.cancel()  # the blocks it reads go back to the cache now
        self.buffer.release(turn.handoff)  # now, or once the PE is done writing into it or gone

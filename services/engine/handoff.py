"""The hand-off of a prompt prefilled elsewhere: the DE buffer a prefill engine (PE) writes the prompt's KV
into, and the PE's DONE notice (`PrefillDone`) after which the engine that decodes takes the request over.

Used by DualPath's DE (`decode_connector.py`) and by a session engine's remote turns (`session_remote.py`).
Ownership: the connector record that holds a `Handoff` owns its extent; `release` frees it at once when the
PE's DONE is in, else only once the PE is done writing or gone (`ReceiveArea.drain`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gpu.sampling import GREEDY_BELOW
from services.engine.connector_context import ConnectorContext
from services.engine.node_storage import NodeStorage
from services.engine.receive_area import DONE_LAYER, DRAIN_GRACE_S, Extent, ReceiveArea
from services.engine.sequence import SeqStatus, Sequence
from shared.blocks import blocks_for
from shared.errors import KvpathError, ProtocolError
from shared.protocol import decode
from shared.protocol.tasks import BufferRef, PrefillDone


@dataclass(slots=True)
class Handoff:
    """One prompt's part of the DE buffer: who writes it, and whether it is done writing."""

    pe_id: str
    extent: Extent
    is_done: bool = False  # the PE's DONE arrived: nobody writes into the extent any more


class DeBuffer:
    """This engine's DE buffer: extents PEs write prompts' KV into, one per handed-off request."""

    def __init__(self, ctx: ConnectorContext, storage: NodeStorage, area_bytes: int) -> None:
        self.kv = ctx.kv
        self.block_size = ctx.block_size
        self.storage = storage  # runs the drains of released extents
        self.area = ReceiveArea(ctx.receiver, "de_buffer", area_bytes, storage.layout, ctx.engine_id)

    def reserve(self, seq: Sequence, pe_id: str) -> Handoff:
        """An extent for the prompt's blocks, written by `pe_id`; OverloadedError when the buffer is full."""
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        n_blocks = blocks_for(seq.num_prompt_tokens, self.block_size)
        extent = self.area.reserve(seq.request_id, n_blocks, ttl_s=remaining + DRAIN_GRACE_S)
        return Handoff(pe_id=pe_id, extent=extent)

    def ref(self, handoff: Handoff) -> BufferRef:
        return self.area.ref(handoff.extent)

    async def wait_done(self, seq: Sequence, handoff: Handoff) -> PrefillDone | None:
        """Wait (until the request's deadline) for the PE's DONE. None when the hand-off failed (the
        sequence's error is set); else a DONE with a first token, or one whose first token ended the
        request on the PE (`finish_reason`, no token: the DE finishes it without one)."""
        remaining = max(0.01, seq.deadline_unix_s - time.time())
        pe_id = handoff.pe_id
        try:
            meta = await self.area.wait(handoff.extent, DONE_LAYER, timeout_s=remaining, peer_id=pe_id)
            done = decode(meta, PrefillDone)
        except ProtocolError as exc:
            handoff.is_done = True
            seq.error_code, seq.error_message = "engine_failed", f"malformed DONE from {pe_id}: {exc}"
            return None
        except KvpathError as exc:
            seq.error_code, seq.error_message = exc.code, f"prefill engine {pe_id}: {exc.message}"
            seq.error_engine = pe_id
            return None
        handoff.is_done = True
        # a DONE without a first token: the PE's first token ended the request (EOS, a stop token), unless
        # another choice still needs the prompt (it needs the first token too)
        ended = bool(done.finish_reason) and all(c.status is SeqStatus.FINISHED for c in seq.pending_choices)
        if done.error or (done.first_token is None and not ended):
            seq.error_code = "engine_failed"
            seq.error_message = f"prefill on {pe_id} failed: {done.error or 'no first token'}"
            return None
        return done

    def import_blocks(self, seq: Sequence, handoff: Handoff, first: int) -> None:
        """Copy the prompt's blocks from `first` on from the buffer into the cache; free the extent."""
        n = blocks_for(seq.num_prompt_tokens, self.block_size)
        first = min(first, n)
        self.kv.import_blocks(seq.block_ids[first:n], self.area.blocks(handoff.extent, first, n - first))
        self.area.free(handoff.extent)

    def release(self, handoff: Handoff, then: Callable[[], None] | None = None) -> None:
        """The request left: free its extent (calling `then` after), now if the PE is done writing, else in
        the background once it is done or gone."""
        if handoff.is_done:
            self.area.free(handoff.extent)
            if then is not None:
                then()
        else:
            self.storage.keep(self._drain(handoff, then))

    async def _drain(self, handoff: Handoff, then: Callable[[], None] | None) -> None:
        await self.area.drain(handoff.extent, DONE_LAYER, peer_id=handoff.pe_id)
        handoff.is_done = True
        if then is not None:
            then()


def take_over(seq: Sequence, done: PrefillDone) -> None:
    """The sequence goes on from the PE's first token, its whole prompt's KV handed over (a load-only
    chunk imports it: nothing to compute)."""
    assert done.first_token is not None, "a DONE without a first token ended the request (wait_done)"
    seq.output_token_ids = [done.first_token]
    seq.next_delta_seq = 1  # delta 0 (the first token) came from the PE
    seq.num_hit_tokens = seq.num_prompt_tokens
    if seq.rng is not None and seq.sampling.temperature >= GREEDY_BELOW:
        seq.rng.random()  # the PE drew the first token's number: continue the request's sequence

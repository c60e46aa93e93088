"""PE side of DualPath: get the stored prefix (own node, or streamed from the DE), stream KV to the DE.

Read side PE (brief §3.3): the prefix is read from the PE node's storage into its DRAM buffer before the
request is batched (read side `pool`, on a PE with `--kv-pool`: the longest prefix the pool holds first,
storage for the rest, `tiered_prefix.py`); layer l of it is copied into the cache right before layer l
computes (the Basic baseline copies every layer before layer 0). Read side DE (§3.4): the PE reserves a
receive area, asks the DE to stream the prefix there (`PullHits`) and, before layer l, waits for that
layer's notice. After layer l the KV the DE needs (hit + miss on the PE path, miss only on the DE path) goes
to the DE buffer; the last layer's writes are awaited before the step ends, so the cache blocks can be
freed after it. The DONE notice (`PrefillDone`: first token, loaded prefix) follows when the request leaves
the PE. With a pool, the prompt's full blocks are written to it once computed (awaited before DONE only
when the request ends here).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable
from collections.abc import Sequence as Seq

import numpy as np

from gpu.runner import LayerHook
from services.engine import metrics
from services.engine.connector import KvConnector
from services.engine.connector_context import ConnectorContext
from services.engine.persist import PersistChain
from services.engine.prefill_hook import PeParts, PeRecord, PrefillHook
from services.engine.receive_area import DONE_LAYER, DRAIN_GRACE_S, ReceiveArea, tag
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from services.engine.tiered_prefix import TieredPrefix
from shared.blocks import ExtentAllocator, blocks_for, max_hit_blocks
from shared.errors import DeadlineExceededError, KvpathError, OverloadedError
from shared.protocol import encode
from shared.protocol.tasks import BufferRef, PrefillDone, PrefillTask, PullHits, PullHitsReply, Task

log = logging.getLogger(__name__)


class PrefillConnector(KvConnector):
    task_type = PrefillTask
    supports_choices = True  # n > 1: the PE prefills choice 0 only; the DE forks the others from its KV
    forks_choices = False

    def __init__(self, ctx: ConnectorContext, *, area_bytes: int, staging_bytes: int) -> None:
        self.bus = ctx.bus
        self.block_size = ctx.block_size
        self.num_layers = ctx.num_layers
        self.timeout_s = ctx.transfer_timeout_s
        self.storage = ctx.node_storage()
        self.area = ReceiveArea(ctx.receiver, "pe_recv", area_bytes, self.storage.layout, ctx.engine_id)
        self.peers = ctx.peers
        self.staging = StagingLine(ExtentAllocator(staging_bytes))
        staging = np.empty(staging_bytes, dtype=np.uint8)
        self.prefix = TieredPrefix(ctx.kv, ctx.tier, self.storage, ctx.block_size)
        layout = self.storage.layout
        self.parts = PeParts(ctx.kv, self.prefix, layout, self.area, ctx.peers, staging, self.timeout_s)

    async def start(self) -> None:
        await self.storage.start()

    async def close(self) -> None:
        await self.prefix.close()
        await self.storage.close()

    def accept(self, seq: Sequence, task: Task) -> None:
        """Reserve staging for the KV sent to the DE, or a place in line for it when the staging buffer is
        full (`load` waits there); OverloadedError only for a prompt larger than the whole buffer."""
        assert isinstance(task, PrefillTask)  # the engine subscribes with `task_type`
        n_blocks = blocks_for(seq.num_prompt_tokens, self.block_size)
        n_bytes = self.storage.layout.blocks_bytes(n_blocks)
        if not self.staging.fits(n_bytes):
            raise OverloadedError(f"prompt larger than the PE staging buffer ({n_blocks} blocks)")
        offset = self.staging.now(n_bytes)
        seq.kv_state = PeRecord(task=task, staging=-1 if offset is None else offset, staging_bytes=n_bytes)
        seq.timings.update(task.timings)

    # --------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        record: PeRecord = seq.kv_state
        if record.staging < 0:  # the staging buffer was full: in line for its room, until the deadline
            metrics.STAGING_WAITS.inc()
            remaining_s = seq.deadline_unix_s - time.time()
            try:
                record.staging = await self.staging.wait(seq.request_id, record.staging_bytes, remaining_s)
            except TimeoutError as exc:
                raise DeadlineExceededError("the PE staging buffer stayed full until the deadline") from exc
        kv = seq.plan.kv
        if kv.num_hit_blocks <= 0 or not kv.read_side:
            return
        started = time.monotonic()
        if kv.read_side in ("pe", "pool"):
            usable = max_hit_blocks(seq.num_prompt_tokens, self.block_size) if kv.read_side == "pool" else 0
            record.prefix = await self.prefix.read(seq, tier_blocks=usable, stored_blocks=kv.num_hit_blocks)
            record.num_loaded_blocks = record.prefix.num_blocks
            record.num_pool_blocks = record.prefix.num_tier_blocks
        else:
            record.num_loaded_blocks = await self._pull(seq, record, kv.num_hit_blocks)
        seq.num_hit_tokens = record.num_loaded_blocks * self.block_size
        seq.timings["read_s"] = time.monotonic() - started

    async def _pull(self, seq: Sequence, record: PeRecord, hits: int) -> int:
        """DE path: reserve the receive area and ask the DE to stream the prefix into it; the blocks it will
        stream (0: recompute the prefix, a miss)."""
        remaining_s = max(0.01, seq.deadline_unix_s - time.time())
        try:
            record.pull = self.area.reserve(seq.request_id, hits, ttl_s=remaining_s + DRAIN_GRACE_S)
            ref = self.area.ref(record.pull)
            reply = await self.bus.request(
                self.bus.subjects.transfer(record.de_id),
                PullHits(request_id=seq.request_id, pe_buffer=ref),
                PullHitsReply,
                timeout_s=remaining_s,
            )
        except KvpathError as exc:  # the DE cannot deliver: recompute the prefix
            if isinstance(exc, DeadlineExceededError):
                record.pull = None  # the DE may still stream into it: the area's reaper frees it at expiry
            metrics.KV_LOAD_MISSES.labels(exc.code).inc(hits)
            log.warning(
                "prefix pull from %s failed request_id=%s: %s", record.de_id, seq.request_id, exc.message
            )
            self._drop_prefix(record)
            return 0
        num_blocks = min(reply.num_blocks, hits)
        metrics.KV_LOADED_BLOCKS.inc(num_blocks)
        return num_blocks

    # ------------------------------------------------------------------------------------ layer hook

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        return PrefillHook(self.parts, chunks)

    def save(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            record: PeRecord = seq.kv_state
            if seq.num_cached_tokens:
                self._drop_prefix(record)  # the prefix is in the cache now
            if record.error is None:  # a failed prefix stream leaves blocks nobody may read
                record.num_pool_blocks, commit = self.prefix.save(seq, record.num_pool_blocks)
                if commit is not None:
                    record.pool_commits.append(commit)

    def failure(self, seq: Sequence) -> KvpathError | None:
        return seq.kv_state.error if seq.kv_state is not None else None

    # ------------------------------------------------------------------------------------ hand-off

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        record: PeRecord | None = seq.kv_state
        if record is None:
            return None
        self.release(seq)
        ends_here = seq.finish_reason in ("stop", "length")  # else handoff (the DE decodes), abort, error
        waits: list[Awaitable[None]] = []
        if ends_here:
            # a request whose first token ends it never reaches a DE: the PE persists its prompt itself
            chain = PersistChain(record.num_loaded_blocks)
            self.storage.persister.persist(seq, chain)
            persisted = self.storage.persister.finish(seq, chain)
            waits = [w for w in (persisted, *record.pool_commits) if w is not None]
        done = PrefillDone(
            first_token=seq.output_token_ids[0] if seq.output_token_ids else None,
            finish_reason=seq.finish_reason if ends_here and seq.finish_reason else "",
            num_loaded_blocks=record.num_loaded_blocks,
            error=seq.error_message,
        )
        return self._notify_done(record.task.de_buffer, encode(done), waits)

    def release(self, seq: Sequence) -> None:
        record: PeRecord | None = seq.kv_state
        if record is None:
            return
        self._drop_prefix(record)
        if record.staging >= 0:
            self.staging.free(record.staging)
            record.staging = -1

    async def _notify_done(self, de: BufferRef, meta: bytes, waits: list[Awaitable[None]]) -> None:
        for wait in waits:  # the request ends here: its writes first
            await wait
        try:
            peer = await self.peers.get(de, timeout_s=self.timeout_s)
            await peer.notify(de.region, tag(de.slot, DONE_LAYER), meta, timeout_s=self.timeout_s)
        except KvpathError as exc:  # the DE learns from its own deadline or our disconnect
            log.warning("DONE notice failed de=%s: %s", de.engine_id, exc.message)

    def _drop_prefix(self, record: PeRecord) -> None:
        self.prefix.release(record.prefix)
        record.prefix = None
        pull, record.pull = record.pull, None
        if pull is None:
            return
        if record.num_pulled_layers >= self.num_layers or record.num_loaded_blocks == 0:
            self.area.free(pull)
        else:  # aborted mid-stream: free once the DE's last layer is in (or the DE is gone)
            self.storage.keep(self.area.drain(pull, self.num_layers - 1, peer_id=record.de_id))


class StagingLine:
    """The PE's staging buffer and the requests waiting for room in it, first come first served: one whose
    KV does not fit waits for the requests before it to send theirs (a burst queues at the PE instead of
    being refused, which failed the requests of the session policies with 429s)."""

    def __init__(self, extents: ExtentAllocator) -> None:
        self.extents = extents
        self._line: OrderedDict[str, tuple[int, asyncio.Future[int]]] = OrderedDict()

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` fit in the empty buffer at all (its whole aligned extents)."""
        align, capacity = self.extents.alignment, self.extents.capacity_bytes
        return -(-nbytes // align) * align <= capacity - capacity % align

    def now(self, nbytes: int) -> int | None:
        """An extent at once, unless the buffer is full or others wait (None: `wait` for it)."""
        return None if self._line else self.extents.allocate(nbytes)

    async def wait(self, request_id: str, nbytes: int, timeout_s: float) -> int:
        """An extent once the requests before this one have theirs and room frees; TimeoutError after
        `timeout_s`. A request that leaves while waiting (cancelled) leaves the line."""
        granted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._line[request_id] = (nbytes, granted)
        try:
            return await asyncio.wait_for(granted, max(0.0, timeout_s))
        except BaseException:
            if granted.done() and not granted.cancelled():  # granted as it gave up: give it back
                self.free(granted.result())
            raise
        finally:
            self._line.pop(request_id, None)

    def free(self, offset: int) -> None:
        self.extents.free(offset)
        while self._line:
            request_id, (nbytes, granted) = next(iter(self._line.items()))
            if granted.done():  # it gave up
                self._line.pop(request_id)
                continue
            extent = self.extents.allocate(nbytes)
            if extent is None:
                return  # the head still does not fit: everyone behind it waits too (no overtaking)
            self._line.pop(request_id)
            granted.set_result(extent)

"""Persist every KV block that fills, through the node's storage service (one per engine).

After a step, the blocks of a sequence that became full are exported into the storage client's staging
segment (a memcpy on the loop, so the cache blocks may be freed right after) and written by a background
task, under the hashes the router planned for the prompt (`Sequence.block_hashes`), extended here for the
blocks generated tokens fill. A sequence's progress is its `PersistChain`, kept in its connector record.
`finish` gives the awaitable a request's last token waits on: its writes durable and applied by the index
(bounded by PERSIST_WAIT_S), so the next turn of a session hits them. No request waits on an index that is
down or lagging: after one wait fails, finishing requests wait only for their writes to be durable until a
background probe sees the index apply events again (it replays them from JetStream when it is back).
Blocks are staged in chain order, as many as the staging segment has room for: when it is full (earlier
writes still on their way), the rest wait for the sequence's next step. Blocks still unstaged when the
request finishes are held in the cache (one more owner each) and staged as writes free space, within
PERSIST_WAIT_S; what is still unstaged then is dropped (counted as `staging_full`, logged at most every
STAGING_WARN_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from services.engine import metrics
from services.engine.sequence import Sequence
from shared import telemetry
from shared.background import Background
from shared.errors import KvpathError
from shared.hashing import chain_root, fingerprint_seed, next_block_hash
from shared.kvclient import IndexClient, StagedBlocks, StorageClient

log = logging.getLogger(__name__)

PERSIST_WAIT_S = 2.0  # longest a finished request waits for its blocks to become durable
INDEX_PROBE_S = 5.0  # one wait of the probe that watches a lagging index catch up
WRITE_FAILED = -1  # what a write's task returns when it failed (else the stream sequence of its events)
STAGING_WARN_S = 60.0  # at most one warning this often about blocks lost to a full staging segment


@dataclass(slots=True)
class PersistChain:
    """How far one sequence's blocks are persisted, and the writes on their way."""

    num_persisted_blocks: int  # leading blocks already in the store (loaded or written), or staged
    num_unstaged_blocks: int = 0  # full blocks after those that the staging segment had no room for yet
    is_broken: bool = False  # staging failed: later blocks could never be matched, so none is written
    writes: list[asyncio.Task[int]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # the blocks [start, end) of each write

    def fork(self) -> PersistChain:
        """The chain of a choice forked from this sequence: the same blocks persisted or on their way,
        written by this sequence's writes (the choice waits for them, and counts them, as its own)."""
        return PersistChain(self.num_persisted_blocks, writes=list(self.writes), spans=list(self.spans))

    def num_written_blocks(self) -> int:
        """Leading blocks known to be in the store: those it started with, then each write's while the
        writes ended without failing (one still on its way, or failed, ends the count)."""
        count = self.spans[0][0] if self.spans else self.num_persisted_blocks
        for (_, end), write in zip(self.spans, self.writes, strict=True):
            if not write.done() or write.cancelled() or write.exception() is not None or write.result() < 0:
                break
            count = end
        return count


def root_of(seq: Sequence, seed: int) -> int:
    """The parent hash of the sequence's first block: the fingerprint seed, salted by its plan's salt."""
    return chain_root(seed, seq.plan.kv.salt)


def extend_hashes(seq: Sequence, num_blocks: int, seed: int, block_size: int) -> list[int]:
    """`seq.block_hashes`, extended (in place) to cover its first `num_blocks` full blocks."""
    hashes = seq.block_hashes
    parent = hashes[-1] if hashes else root_of(seq, seed)
    for i in range(len(hashes), num_blocks):
        parent = next_block_hash(parent, seq.token_ids(i * block_size, (i + 1) * block_size))
        hashes.append(parent)
    return hashes


class BlockPersister:
    def __init__(self, client: StorageClient, index: IndexClient, kv: Any, block_size: int) -> None:
        self.client = client
        self.index = index
        self.kv = kv
        self.block_size = block_size
        self.seed = fingerprint_seed(client.fingerprint)
        self._background = Background()  # every write in flight (cancelled on close)
        self.index_lagging = False  # requests do not wait on the index (a probe watches it catch up)
        self._staging_warned_at = -STAGING_WARN_S
        self._staging_freed = asyncio.Event()  # set when a write ends (its staging space is free again)
        self.holds_unstaged = True  # finish() holds blocks left unstaged (False: drops and counts them)

    def persist(self, seq: Sequence, chain: PersistChain) -> None:
        """Write the sequence's blocks that became full since the last call (the leading ones that fit in
        the staging segment now; the rest at a later call)."""
        full = seq.num_computed_tokens // self.block_size
        start = chain.num_persisted_blocks
        if full <= start or chain.is_broken:
            return
        chain.num_unstaged_blocks = full - start
        try:
            staged = self.client.stage_up_to(full - start)
        except KvpathError as exc:
            metrics.KV_PERSIST_FAILURES.labels(exc.code).inc(full - start)
            chain.is_broken, chain.num_unstaged_blocks = True, 0
            return
        if staged is None:
            return  # the staging segment is full: the sequence's next step tries again
        end = start + staged.num_blocks
        self.kv.export_blocks(seq.block_ids[start:end], staged.views)
        chained = extend_hashes(seq, end, self.seed, self.block_size)
        hashes = chained[start:end]
        parents = [chained[start - 1] if start else root_of(seq, self.seed), *hashes[:-1]]
        chain.num_persisted_blocks, chain.num_unstaged_blocks = end, full - end
        # the write's bus request (and the storage service's span) belongs to the request's trace
        context = telemetry.task_context(seq.trace.parent) if seq.trace is not None else None
        write = asyncio.create_task(self._write(seq.request_id, staged, hashes, parents), context=context)
        chain.writes.append(write)
        chain.spans.append((start, end))
        self._background.keep(write)

    async def _write(
        self, request_id: str, staged: StagedBlocks, hashes: list[int], parents: list[int]
    ) -> int:
        try:
            result = await self.client.write(staged, hashes, parents, request_id=request_id)
        except KvpathError as exc:
            self._staging_freed.set()
            metrics.KV_PERSIST_FAILURES.labels(exc.code).inc(len(hashes))
            log.warning(
                "persist failed request_id=%s code=%s: %s", request_id, exc.code, exc.message,
                extra={"request_id": request_id},
            )  # fmt: skip
            return WRITE_FAILED
        self._staging_freed.set()
        metrics.KV_PERSISTED_BLOCKS.inc(result.num_written)
        return result.event_stream_seq

    async def wait_written(self, chain: PersistChain, deadline_unix_s: float) -> None:
        """Until the chain's writes so far have ended (written or failed), at most PERSIST_WAIT_S and not
        past the deadline: a preempted sequence then reads back what it wrote (what is not written yet is
        recomputed)."""
        timeout = min(PERSIST_WAIT_S, deadline_unix_s - time.time())
        if chain.writes and timeout > 0:
            await asyncio.wait(list(chain.writes), timeout=timeout)

    def finish(self, seq: Sequence, chain: PersistChain) -> Awaitable[None] | None:
        """The awaitable (None: nothing written) that ends once the chain's writes are indexed. Blocks the
        staging segment had no room for yet are held now (before the engine frees the sequence's blocks)
        and written as space frees."""
        if chain.num_unstaged_blocks and not chain.is_broken and self.holds_unstaged:
            span = (chain.num_persisted_blocks, chain.num_persisted_blocks + chain.num_unstaged_blocks)
            write = asyncio.create_task(self._write_held(seq, chain))
            chain.writes.append(write)
            chain.spans.append(span)
            self._background.keep(write)
        elif chain.num_unstaged_blocks:
            self._lost_to_staging(seq.request_id, chain.num_unstaged_blocks)
            chain.num_unstaged_blocks = 0
        if not chain.writes:
            return None
        return self._wait_indexed(seq.request_id, chain.writes)

    def _write_held(self, seq: Sequence, chain: PersistChain) -> Coroutine[Any, Any, int]:
        """Hold the chain's unstaged full blocks and return the work that writes them (the stream sequence
        of its last write, 0 if none)."""
        start = chain.num_persisted_blocks
        end = start + chain.num_unstaged_blocks
        held = list(seq.block_ids[start:end])
        self.kv.share(held)
        chained = extend_hashes(seq, end, self.seed, self.block_size)
        hashes = chained[start:end]
        parents = [chained[start - 1] if start else root_of(seq, self.seed), *hashes[:-1]]
        chain.num_persisted_blocks, chain.num_unstaged_blocks = end, 0
        return self._stage_held(seq.request_id, held, hashes, parents)

    async def _stage_held(
        self, request_id: str, held: list[int], hashes: list[int], parents: list[int]
    ) -> int:
        deadline = time.monotonic() + PERSIST_WAIT_S
        writes: list[asyncio.Task[int]] = []
        done = 0
        try:
            while done < len(held):
                staged = self.client.stage_up_to(len(held) - done)
                if staged is None:
                    self._staging_freed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._staging_freed.wait(), deadline - time.monotonic())
                    if time.monotonic() >= deadline:
                        break
                    continue
                part = slice(done, done + staged.num_blocks)
                self.kv.export_blocks(held[part], staged.views)
                self.kv.free(held[part])
                write = self._write(request_id, staged, hashes[part], parents[part])
                writes.append(asyncio.create_task(write))
                done = part.stop
        finally:
            if done < len(held):
                self.kv.free(held[done:])
                self._lost_to_staging(request_id, len(held) - done)
        return max(await asyncio.gather(*writes), default=0)

    def _lost_to_staging(self, request_id: str, num_blocks: int) -> None:
        metrics.KV_PERSIST_FAILURES.labels("staging_full").inc(num_blocks)
        now = time.monotonic()
        if now - self._staging_warned_at >= STAGING_WARN_S:
            self._staging_warned_at = now
            log.warning(
                "request_id=%s: %d full blocks not persisted: the staging segment (%d B) stayed full "
                "for %.0f s past the request; raise the engine's storage_staging_bytes (logged at most "
                "every %.0f s)",
                request_id, num_blocks, self.client.staging_bytes, PERSIST_WAIT_S, STAGING_WARN_S,
                extra={"request_id": request_id},
            )  # fmt: skip

    async def _wait_indexed(self, request_id: str, writes: list[asyncio.Task[int]]) -> None:
        deadline = time.monotonic() + PERSIST_WAIT_S
        done, pending = await asyncio.wait(writes, timeout=PERSIST_WAIT_S)  # pending ones keep writing
        stream_seqs = [t.result() for t in done if not t.cancelled() and t.exception() is None]
        last = max(stream_seqs, default=0)
        if last > 0 and not pending and not self.index_lagging:
            try:
                remaining = max(0.01, deadline - time.monotonic())
                await self.index.wait_applied(last, timeout_s=remaining, fail_fast=True)
            except KvpathError as exc:
                if not self.index_lagging:
                    log.warning("index lags (%s): requests stop waiting for it until it is back", exc.message)
                    self.index_lagging = True
                    self._background.keep(self._watch_index(last))

    async def _watch_index(self, stream_seq: int) -> None:
        """Until the index applied `stream_seq`: then requests wait for it again."""
        while True:
            try:
                await self.index.wait_applied(stream_seq, timeout_s=INDEX_PROBE_S)
            except KvpathError:
                continue  # wait_applied paces its own polls
            log.info("index caught up (stream seq %d): requests wait for it again", stream_seq)
            self.index_lagging = False
            return

    async def close(self) -> None:
        await self._background.close()

"""The remote-memory KV tier (`--kv-remote <store>`): the baseline Beluga is measured against, vLLM + LMCache
+ Mooncake store, as kvpath's colocated connector sees it (`KvTier`).

CPU-driven, two copies each way, in 256-token super blocks (`remote_cache.py`), through an engine-local DRAM
cache of super blocks (LMCache's `local_cpu` backend) registered as a region of the engine's `KvReceiver`:
  read:  GET -> the store writes the super blocks into cache slots over the data plane (copy 1, the network
         write into the bounce buffer) -> `import_layer` copies each layer into the paged cache (copy 2).
         A super block already in the local cache skips the GET.
  write: `export_blocks` copies a super block that became whole from the paged cache into a cache slot
         (copy 1, the bounce buffer) -> PUT reserves a slot in the store -> one `write_many` puts the slots
         into the store's region (copy 2) -> COMMIT publishes them. The slot stays cached locally.
The local cache is announced to the index as location `dram:<engine_id>` (BlockStored with every block of a
cached super block, BlockRemoved when it is evicted), so a cache-aware router sees which engine holds what.
A store that is down, slow or full is a miss or a skipped write, counted, never a failed request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from services.engine import metrics
from services.engine.remote_cache import CacheEntry, SuperBlockCache, chunk_keys, completed_chunks
from services.engine.remote_client import RemoteStoreClient
from services.engine.remote_events import CacheAnnouncer
from services.engine.sequence import Sequence
from shared.background import Background
from shared.blocks import BlockLayout, full_blocks_view
from shared.errors import ConfigError, KvpathError, ServiceUnavailableError
from shared.hashing import chain_root
from shared.protocol.kv import RemoteKvTarget
from shared.transport import KvReceiver

log = logging.getLogger(__name__)

CACHE_REGION = "remotekv-cache"


@dataclass(slots=True)
class RemoteRead:
    """Super blocks held for one sequence (pinned in the local cache) until they are in the paged cache."""

    lease_id: int
    entries: list[CacheEntry]
    runs: list[tuple[int, int, np.ndarray]]  # (first block, blocks, [blocks, L, bs, bytes] view of the slots)

    @property
    def num_blocks(self) -> int:
        return sum(count for _, count, _ in self.runs)


class RemoteTier:
    def __init__(
        self,
        client: RemoteStoreClient,
        receiver: KvReceiver,
        announcer: CacheAnnouncer,
        layout: BlockLayout,
        kv: Any,
        *,
        engine_id: str,
        seed: int,
        chunk_blocks: int,
        cache_bytes: int,
        verify_checksums: bool = True,
    ) -> None:
        self.client = client
        self.verify_checksums = verify_checksums
        self.announcer = announcer
        self.layout = layout
        self.kv = kv
        self.engine_id = engine_id
        self.seed = seed  # parent of block 0 (the fingerprint's hash)
        self.chunk_blocks = chunk_blocks
        self.chunk_bytes = chunk_blocks * layout.full_block_bytes
        if cache_bytes < self.chunk_bytes:
            raise ConfigError(
                f"remote_cache_bytes={cache_bytes} holds no super block of {self.chunk_bytes} bytes",
                param="remote_cache_bytes",
            )
        self.cache = SuperBlockCache(cache_bytes // self.chunk_bytes)
        self.receiver = receiver
        self.region = receiver.register_region(CACHE_REGION, self.cache.num_slots * self.chunk_bytes)
        self.arena = self.region.array()
        client.sender.register_memory(self.arena)  # rdma: uploads from any slot without per-op MRs
        self._reads: dict[int, RemoteRead] = {}
        self._lease_ids = itertools.count(1)
        self._fills: dict[int, asyncio.Future[None]] = {}  # key -> the GET in flight that fills it
        self._background = Background()
        self._quarantine: set[asyncio.TimerHandle] = set()
        metrics.REMOTE_CACHE_USED_BYTES.set_function(lambda: len(self.cache) * self.chunk_bytes)

    async def start(self) -> None:
        await self.announcer.start()

    # ------------------------------------------------------------------------------------------ read

    async def read(self, seq: Sequence, num_blocks: int) -> RemoteRead | None:
        """Pin the longest prefix of whole super blocks in the first `num_blocks` blocks: local ones first,
        then fetched from the store into the local cache."""
        keys = chunk_keys(seq.block_hashes, num_blocks, self.chunk_blocks)
        if not keys:
            return None
        num_local = await self._ready_prefix(seq, keys)
        entries = self.cache.pin(keys[:num_local])
        if num_local < len(keys):
            entries += await self._fetch(seq, keys, num_local)
        metrics.REMOTE_CHUNKS.labels("local_hit").inc(num_local)
        metrics.REMOTE_CHUNKS.labels("remote_hit").inc(len(entries) - num_local)
        metrics.REMOTE_CHUNKS.labels("miss").inc(len(keys) - len(entries))
        if not entries:
            return None
        read = RemoteRead(next(self._lease_ids), entries, self._runs(entries))
        self._reads[read.lease_id] = read
        return read

    async def _ready_prefix(self, seq: Sequence, keys: list[int]) -> int:
        """How many leading keys are READY here, once the GETs other requests have in flight for the next
        ones have landed (within this request's deadline): a request for a document another is fetching
        waits for that GET instead of recomputing what it brings (popular documents are asked for by several
        requests at once)."""
        num_ready = self.cache.ready_prefix(keys)
        while num_ready < len(keys) and (fill := self._fills.get(keys[num_ready])) is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fill), self._timeout_s(seq))
            if not fill.done():
                break
            num_ready = self.cache.ready_prefix(keys)
        return num_ready

    def _timeout_s(self, seq: Sequence) -> float:
        return min(self.client.timeout_s, max(0.01, seq.deadline_unix_s - time.time()))

    async def _fetch(self, seq: Sequence, keys: list[int], first: int) -> list[CacheEntry]:
        """GET keys[first:] (as far as the local cache has room) into fresh cache slots; the entries the
        store had, published and pinned. Requests reading the same keys meanwhile wait for it."""
        wanted = [e for _, e in self._reserve(seq, range(first, len(keys)), stop_at_held=True)]
        if not wanted:
            return []
        fill: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._fills.update((e.key, fill) for e in wanted)
        try:
            return await self._get(seq, wanted)
        finally:
            for e in wanted:
                if self._fills.get(e.key) is fill:
                    del self._fills[e.key]
            fill.set_result(None)

    async def _get(self, seq: Sequence, wanted: list[CacheEntry]) -> list[CacheEntry]:
        timeout_s = self._timeout_s(seq)
        target = RemoteKvTarget(
            engine_id=self.engine_id,
            endpoint=self.receiver.endpoint(),
            region=CACHE_REGION,
            offsets=[e.slot * self.chunk_bytes for e in wanted],
        )
        started = time.perf_counter()
        try:
            link = await self.client.link()
            reply = await self.client.get(link, seq.request_id, [e.key for e in wanted], target, timeout_s)
        except KvpathError as exc:
            self.client.failed(exc)
            metrics.REMOTE_ERRORS.labels("get", exc.code).inc()
            if isinstance(exc, ServiceUnavailableError):  # the GET never reached a store: nothing can land
                self._drop(wanted)
            else:  # the store may be writing still: free the slots after its own deadline
                self._quarantine_slots(wanted, 2 * timeout_s)
            return []
        metrics.REMOTE_OP_SECONDS.labels("get").observe(time.perf_counter() - started)
        num_hit = reply.num_hit_chunks
        if self.verify_checksums and num_hit:
            num_hit = self._verified_prefix(seq, wanted[:num_hit], reply.checksums)
        hit = wanted[:num_hit]
        self._drop(wanted[num_hit:])  # the store wrote nothing there, or bytes that do not match
        for entry in hit:
            self.cache.publish(entry)
        metrics.REMOTE_BYTES.labels("in").inc(len(hit) * self.chunk_bytes)
        if hit:
            self._keep(self.announcer.stored(hit))
        return hit

    def _verified_prefix(self, seq: Sequence, entries: list[CacheEntry], checksums: list[int]) -> int:
        """How many leading fetched super blocks match the checksums their writer committed (a store that
        sent none, an older one: all of them). Checked once, as they land; the local cache keeps them as
        they are, so a local hit later is not hashed again."""
        if len(checksums) != len(entries):
            return len(entries)
        for i, (entry, want) in enumerate(zip(entries, checksums, strict=True)):
            if want and self._checksum(entry) != want:
                metrics.REMOTE_CHUNKS.labels("corrupt").inc()
                log.warning(
                    "remote super block %d of request_id=%s is corrupt: a miss from there", i, seq.request_id
                )
                return i
        return len(entries)

    def _checksum(self, entry: CacheEntry) -> int:
        start = entry.slot * self.chunk_bytes
        return xxhash.xxh3_64_intdigest(self.arena[start : start + self.chunk_bytes].data)

    def _reserve(self, seq: Sequence, chunks: range, *, stop_at_held: bool) -> list[tuple[int, CacheEntry]]:
        """(super block, FILLING entry) for these super blocks of the sequence, in order. One held (or being
        filled) already ends the run when `stop_at_held` (a read wants a prefix), else is skipped; a full
        cache (every slot pinned) ends it."""
        cb, hashes, out = self.chunk_blocks, seq.block_hashes, []
        for c in chunks:
            key = hashes[(c + 1) * cb - 1]
            if self.cache.get(key) is not None:
                if stop_at_held:
                    break
                continue
            parent = hashes[c * cb - 1] if c else chain_root(self.seed, seq.plan.kv.salt)
            entry, evicted = self.cache.reserve(key, hashes[c * cb : (c + 1) * cb], parent)
            if evicted:
                metrics.REMOTE_CACHE_EVICTIONS.inc(len(evicted))
                self._keep(self.announcer.removed(evicted))
            if entry is None:
                metrics.REMOTE_CHUNKS.labels("cache_full").inc()
                break
            out.append((c, entry))
        return out

    def _runs(self, entries: list[CacheEntry]) -> list[tuple[int, int, np.ndarray]]:
        """Runs of consecutive slots as block views: one import per run, never per block."""
        runs: list[tuple[int, int, np.ndarray]] = []
        cb, i = self.chunk_blocks, 0
        while i < len(entries):
            j = i + 1
            while j < len(entries) and entries[j].slot == entries[j - 1].slot + 1:
                j += 1
            offset = entries[i].slot * self.chunk_bytes
            view = full_blocks_view(self.arena, offset, (j - i) * cb, self.layout)
            runs.append((i * cb, (j - i) * cb, view))
            i = j
        return runs

    def import_layer(self, block_ids: list[int], read: RemoteRead, layer: int) -> None:
        """Layer `layer` of the leased super blocks into cache blocks `block_ids` (copy 2 of a read)."""
        for first, count, blocks in read.runs:
            self.kv.import_layer(block_ids[first : first + count], layer, blocks[:, layer])

    def import_blocks(self, block_ids: list[int], read: RemoteRead) -> None:
        """Every layer of the leased blocks into the cache blocks `block_ids` (one copy per run)."""
        for first, count, blocks in read.runs:
            self.kv.import_blocks(block_ids[first : first + count], blocks)

    def release(self, read: RemoteRead | int) -> None:
        """Unpin a read's super blocks (idempotent; takes the read or its lease id)."""
        lease_id = read if isinstance(read, int) else read.lease_id
        held = self._reads.pop(lease_id, None)
        if held is not None:
            self.cache.unpin(held.entries)

    # ----------------------------------------------------------------------------------------- write

    def write(self, seq: Sequence, start: int, end: int, parent: int) -> Awaitable[None] | None:
        """Store the super blocks that became whole with blocks [start, end): copied into local cache slots
        now (the paged blocks may be freed after this returns), uploaded and announced in the background;
        the awaitable ends once they are committed in the store and the index knows the local copies."""
        reserved = self._reserve(seq, completed_chunks(start, end, self.chunk_blocks), stop_at_held=False)
        if not reserved:
            return None
        cb = self.chunk_blocks
        for c, entry in reserved:  # copy 1: paged cache -> bounce buffer, one export per super block
            view = full_blocks_view(self.arena, entry.slot * self.chunk_bytes, cb, self.layout)
            self.kv.export_blocks(seq.block_ids[c * cb : (c + 1) * cb], view)
            self.cache.publish(entry)  # locally readable now; the filler's pin holds it for the upload
        return self._keep(self._store(seq.request_id, [e for _, e in reserved]))

    async def _store(self, request_id: str, entries: list[CacheEntry]) -> None:
        try:
            await asyncio.gather(
                self.announcer.stored(entries, wait_applied=True), self._upload(request_id, entries)
            )
        finally:
            self.cache.unpin(entries)

    async def _upload(self, request_id: str, entries: list[CacheEntry]) -> None:
        """PUT, one write of every reserved slot (copy 2: bounce buffer -> remote DRAM), COMMIT."""
        started = time.perf_counter()
        try:
            link = await self.client.link()
            reply = await self.client.put(link, request_id, [e.key for e in entries])
        except KvpathError as exc:
            self.client.failed(exc)
            metrics.REMOTE_ERRORS.labels("put", exc.code).inc()
            metrics.REMOTE_CHUNKS.labels("write_skipped").inc(len(entries))
            return
        for outcome in ("exists", "full"):
            metrics.REMOTE_CHUNKS.labels(outcome).inc(reply.outcomes.count(outcome))
        picked = [
            (e, off) for e, off, ok in zip(entries, reply.offsets, reply.outcomes, strict=True) if ok == "ok"
        ]
        if not picked:
            return
        pieces = [
            (off, self.arena[e.slot * self.chunk_bytes : (e.slot + 1) * self.chunk_bytes])
            for e, off in picked
        ]
        written = [e.key for e, _ in picked]
        checksums = [self._checksum(e) for e, _ in picked] if self.verify_checksums else []
        try:
            await self.client.write(link, pieces)
        except KvpathError as exc:
            self.client.failed(exc)
            metrics.REMOTE_ERRORS.labels("write", exc.code).inc()
            written = []
        try:
            committed = (
                await self.client.commit(reply.put_id, written, checksums if written else [])
            ).num_committed
        except KvpathError as exc:  # uncommitted slots go back at the reservation's deadline
            self.client.failed(exc)
            metrics.REMOTE_ERRORS.labels("commit", exc.code).inc()
            committed = 0
        metrics.REMOTE_CHUNKS.labels("written").inc(committed)
        metrics.REMOTE_CHUNKS.labels("write_error").inc(len(picked) - committed)
        metrics.REMOTE_BYTES.labels("out").inc(committed * self.chunk_bytes)
        metrics.REMOTE_OP_SECONDS.labels("store").observe(time.perf_counter() - started)

    # ----------------------------------------------------------------------------------------- tasks

    def _drop(self, entries: list[CacheEntry]) -> None:
        for entry in entries:
            self.cache.drop(entry)

    def _quarantine_slots(self, entries: list[CacheEntry], delay_s: float) -> None:
        """Free the slots of a failed GET only after the store's own deadline for writing them has passed."""

        def drop() -> None:
            self._quarantine.discard(handle)
            self._drop(entries)

        handle = asyncio.get_running_loop().call_later(delay_s, drop)
        self._quarantine.add(handle)

    def _keep(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        return self._background.keep(work)

    async def close(self) -> None:
        for handle in self._quarantine:
            handle.cancel()
        self._quarantine.clear()
        await self._background.close(grace_s=1.0)
        await self.announcer.close()
        await self.client.close()
        self._reads.clear()
        self.arena = np.empty(0, dtype=np.uint8)
        try:
            self.receiver.unregister_region(CACHE_REGION)
        except KvpathError as exc:  # the receiver closed first
            log.debug("cache region already gone: %s", exc.message)

"""Write path: blocks an engine staged in its own shared-memory segment -> durable files -> BlockStored.

The engine copies blocks into its staging segment and names (segment, offsets); this service maps the
segment by name and writes each file from a memoryview of it (no KV bytes on NATS, no extra copy).
Capacity is reserved in the LRU catalog before a file is written (a request's blocks at once, pinned until
their write settles, whoever awaits it), evicting least recently used chain tails (`lru.py`, announced as
BlockRemoved) when needed; what finds no room fails as storage full. The reply comes once the files are
durable (see `block_store.fsync_policy`) and the BlockStored event is in the stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from services.storage import metrics
from services.storage.block_store import HEADER_BYTES, BlockStore
from services.storage.disk_room import disk_capacity
from services.storage.lru import BlockKey, LruCatalog
from services.storage.token_bucket import TokenBucket
from shared.errors import InvalidRequestError, KvpathError, OverloadedError, StorageError, StorageFullError
from shared.hashing import fingerprint_seed
from shared.protocol.kv import StorageWriteReply, StorageWriteRequest
from shared.shm import ShmSegment, segment_path

_U64_MAX = (1 << 64) - 1

AnnounceStored = Callable[[list[int], list[int], int], Awaitable[int]]  # hashes, parents, block_tokens -> seq
AnnounceRemoved = Callable[[str, list[int]], Awaitable[None]]  # reason, hashes


@dataclass(slots=True)
class WriterLimits:
    max_concurrent_writes: int
    max_pending_writes: int
    max_blocks_per_request: int
    max_attached_segments: int
    is_shared_root: bool = False
    follows_disk: bool = False  # no capacity configured: the file system's free room is it (`disk_room.py`)
    min_free_bytes: int = -1  # then the free space kept on the file system (-1: the default)


class SegmentCache:
    """Engine staging segments mapped by name, re-mapped when the name points at a new file."""

    def __init__(self, max_segments: int) -> None:
        self.max_segments = max_segments
        self._segments: OrderedDict[str, tuple[ShmSegment, np.ndarray, int]] = OrderedDict()

    def array(self, name: str) -> np.ndarray:
        try:
            inode = os.stat(segment_path(name)).st_ino
        except (FileNotFoundError, ValueError) as exc:
            raise InvalidRequestError(
                f"staging segment {name!r} not found: {exc}", param="segment_name"
            ) from None
        cached = self._segments.get(name)
        if cached is not None and cached[2] == inode:
            self._segments.move_to_end(name)
            return cached[1]
        if cached is not None:
            cached[0].close()
        seg = ShmSegment.attach(name)
        self._segments[name] = (seg, seg.array(), inode)
        while len(self._segments) > self.max_segments:
            _, (old, _, _) = self._segments.popitem(last=False)
            old.close()
        return self._segments[name][1]

    def close(self) -> None:
        for seg, _, _ in self._segments.values():
            seg.close()
        self._segments.clear()


class BlockWriter:
    def __init__(
        self,
        *,
        store: BlockStore,
        catalog: LruCatalog,
        bucket: TokenBucket,
        executor: concurrent.futures.ThreadPoolExecutor,
        limits: WriterLimits,
        announce_stored: AnnounceStored,
        announce_removed: AnnounceRemoved,
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.bucket = bucket
        self.limits = limits
        self.segments = SegmentCache(limits.max_attached_segments)
        self._executor = executor
        self._announce_stored = announce_stored
        self._announce_removed = announce_removed
        self._io_slots = asyncio.Semaphore(limits.max_concurrent_writes)
        self._room_lock = asyncio.Lock()
        # block -> the claim of the request that writes it, from before its room is reserved until its file
        # is written or given up; `_writing`: the claimed blocks whose I/O has begun (it settles them)
        self._inflight: dict[BlockKey, asyncio.Future[bool]] = {}
        self._writing: set[BlockKey] = set()
        self._num_pending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_pending(self) -> int:
        return self._num_pending

    async def write(self, req: StorageWriteRequest) -> StorageWriteReply:
        self._validate(req)
        if self._num_pending >= self.limits.max_pending_writes:
            raise OverloadedError(f"{self._num_pending} writes pending on this node; retry later")
        self._num_pending += 1
        self._idle.clear()
        try:
            return await asyncio.wait_for(self._write(req), req.timeout_s)
        except TimeoutError:
            metrics.WRITE_ERRORS.labels("timeout").inc()
            raise StorageError(
                f"write of {len(req.block_hashes)} blocks not done within {req.timeout_s}s"
            ) from None
        finally:
            self._num_pending -= 1
            if self._num_pending == 0:
                self._idle.set()

    def _validate(self, req: StorageWriteRequest) -> None:
        n = len(req.block_hashes)
        if not req.request_id or not req.fingerprint or not req.segment_name:
            raise InvalidRequestError("request_id, fingerprint and segment_name must not be empty")
        if not 0 < n <= self.limits.max_blocks_per_request:
            raise InvalidRequestError(
                f"a write names 1..{self.limits.max_blocks_per_request} blocks, got {n}", param="block_hashes"
            )
        if len(req.offsets) != n or len(req.parent_hashes) != n:
            raise InvalidRequestError(
                f"{n} block hashes but {len(req.offsets)} offsets and {len(req.parent_hashes)} parents"
            )
        if any(not 0 <= h <= _U64_MAX for h in (*req.block_hashes, *req.parent_hashes)):
            raise InvalidRequestError("block hashes are unsigned 64-bit integers", param="block_hashes")
        if req.block_bytes <= 0 or req.timeout_s <= 0:
            raise InvalidRequestError("block_bytes and timeout_s must be > 0", param="block_bytes")

    async def _write(self, req: StorageWriteRequest) -> StorageWriteReply:
        source = self.segments.array(req.segment_name)
        if any(off < 0 or off + req.block_bytes > source.nbytes for off in req.offsets):
            raise InvalidRequestError(
                f"an offset lies outside segment {req.segment_name} of {source.nbytes} B", param="offsets"
            )
        fp_hash = fingerprint_seed(req.fingerprint)
        keys: list[BlockKey] = [(fp_hash, h) for h in req.block_hashes]
        # the same block written by another request right now: that write owns it. Wait until none of ours
        # is claimed, then claim the new ones with no wait in between: a block in the catalog and claimed
        # by nobody has its file, so it is announced as existing only once it exists
        while owners := [f for key in keys if (f := self._inflight.get(key)) is not None]:
            await asyncio.wait(owners)
        now = time.time()
        new = [i for i in reversed(range(len(keys))) if not self.catalog.touch(keys[i], now)][::-1]
        claims = {keys[i]: asyncio.get_running_loop().create_future() for i in new}
        self._inflight.update(claims)
        # the blocks this request will announce stay pinned until their BlockStored is in the stream: an
        # eviction before would publish their BlockRemoved first (the index then keeps a removed block)
        is_new = set(new)
        announced = [key for i, key in enumerate(keys) if i not in is_new]
        self._pin(announced)
        reserved: list[BlockKey] = []
        try:
            file_bytes = HEADER_BYTES + req.block_bytes
            reserved = await self._reserve(
                [keys[i] for i in new], [req.parent_hashes[i] for i in new], file_bytes
            )
            self._pin(reserved)  # besides the write's own pin, which its outcome settles
            announced += reserved
            return await self._write_reserved(req, keys, new, len(reserved), source, file_bytes)
        finally:
            for key in announced:
                self.catalog.unpin(key)
            self._give_up(claims, set(reserved))

    def _give_up(self, claims: dict[BlockKey, asyncio.Future[bool]], reserved: set[BlockKey]) -> None:
        """The claimed blocks whose I/O never began (no room, or the request ended first): their
        reservations go (unpinned, out of the catalog) and the requests waiting for them go on."""
        for key, claim in claims.items():
            if claim.done() or key in self._writing:
                continue  # settled, or its I/O thread settles it
            if key in reserved:
                self.catalog.unpin(key)
                self.catalog.remove(key)
            self._release(key, claim, False)

    def _release(self, key: BlockKey, claim: asyncio.Future[bool], written: bool) -> None:
        if self._inflight.get(key) is claim:
            del self._inflight[key]
        if not claim.done():
            claim.set_result(written)

    def _pin(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self.catalog.pin(key)

    async def _write_reserved(
        self,
        req: StorageWriteRequest,
        keys: list[BlockKey],
        new: list[int],
        num_reserved: int,
        source: np.ndarray,
        file_bytes: int,
    ) -> StorageWriteReply:
        """Write the reserved new blocks (the first `num_reserved` of `new`; the rest found no room), then
        announce every durable block of the request."""
        reserved = new[:num_reserved]
        missing = len(new) - num_reserved
        full = StorageFullError(f"storage full: no room for {missing} blocks of {file_bytes} B")
        results: list[bool | BaseException] = [False] * len(keys)
        for i in new[num_reserved:]:
            results[i] = full
        written = await asyncio.gather(
            *(self._persist(keys[i], req, i, source, file_bytes) for i in reserved),
            return_exceptions=True,
        )
        for i, outcome in zip(new, written, strict=False):
            results[i] = outcome
        return await self._reply(req, results)

    async def _reply(
        self, req: StorageWriteRequest, results: list[bool | BaseException]
    ) -> StorageWriteReply:
        ok = [i for i, r in enumerate(results) if isinstance(r, bool)]
        num_written = sum(1 for i in ok if results[i] is True)
        metrics.WRITE_BLOCKS.labels("written").inc(num_written)
        metrics.WRITE_BLOCKS.labels("existing").inc(len(ok) - num_written)
        seq = 0
        if ok:
            hashes = [req.block_hashes[i] for i in ok]
            parents = [req.parent_hashes[i] for i in ok]
            seq = await self._announce_stored(hashes, parents, req.block_tokens)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            is_full = all(isinstance(e, StorageFullError) for e in errors)
            metrics.WRITE_ERRORS.labels("full" if is_full else "io").inc()
            first = errors[0]
            detail = first.message if isinstance(first, KvpathError) else repr(first)
            error = StorageFullError if is_full else StorageError
            raise error(f"{len(errors)} of {len(results)} blocks not written ({len(ok)} durable): {detail}")
        return StorageWriteReply(
            request_id=req.request_id,
            num_written=num_written,
            num_existing=len(ok) - num_written,
            event_stream_seq=seq,
        )

    async def _persist(
        self, key: BlockKey, req: StorageWriteRequest, i: int, source: np.ndarray, file_bytes: int
    ) -> bool:
        """Write block i (its room reserved and pinned); True when written, False when the file existed.

        The I/O thread's outcome settles the catalog entry whatever happens to this coroutine (a timed
        out request is cancelled, its thread still finishes): one owner, so the catalog cannot drift."""
        loop = asyncio.get_running_loop()
        payload = source[req.offsets[i] : req.offsets[i] + req.block_bytes].data
        async with self._io_slots:
            done_at = self.bucket.reserve(file_bytes, loop.time())
            job = loop.run_in_executor(
                self._executor, self._persist_sync, key, req.parent_hashes[i], payload, req.block_bytes
            )
            self._writing.add(key)
            job.add_done_callback(lambda done: self._settle(key, done))
            written = await asyncio.shield(job)
            if written and done_at > loop.time():
                await asyncio.sleep(done_at - loop.time())
        if written:
            metrics.WRITE_BYTES.inc(file_bytes)
        return bool(written)

    def _settle(self, key: BlockKey, job: asyncio.Future[bool]) -> None:
        """The write of `key` ended: keep its entry (written, or our own existing file), or drop it; then
        the requests waiting on its claim go on."""
        self._writing.discard(key)
        self.catalog.unpin(key)
        ok = not job.cancelled() and job.exception() is None
        if not ok or (not job.result() and self.limits.is_shared_root):
            self.catalog.remove(key)  # not written; or another node's file on the shared root: its own
        else:
            self.catalog.touch(key, time.time())
        metrics.STORE_USED_BYTES.set(self.catalog.used_bytes)
        claim = self._inflight.get(key)
        if claim is not None:
            self._release(key, claim, ok)

    def _persist_sync(self, key: BlockKey, parent_hash: int, payload: memoryview, block_bytes: int) -> bool:
        if self.store.exists(key[0], key[1], block_bytes):
            return False
        self.store.write(key[0], key[1], parent_hash, payload)
        return True

    async def _reserve(self, keys: list[BlockKey], parents: list[int], file_bytes: int) -> list[BlockKey]:
        """Account for new files (a chain's blocks, in order), evicting chain tails least recently used
        first (announced as BlockRemoved); the leading blocks that found room, pinned until written."""
        if not keys:
            return []
        if not self.catalog.can_ever_fit(file_bytes):
            raise StorageFullError(
                f"storage full: a {file_bytes} B block exceeds capacity {self.catalog.capacity_bytes}"
            )
        async with self._room_lock:
            if self.limits.follows_disk:
                await self._follow_disk()
            evicted = await self._evict_for(file_bytes * len(keys))
            free = self.catalog.free_bytes()
            n = len(keys) if free is None else min(len(keys), free // file_bytes)
            now = time.time()
            for key, parent in zip(reversed(keys[:n]), reversed(parents[:n]), strict=True):
                self.catalog.add(key, file_bytes, now, (key[0], parent))  # tail first: the head is newest
                self.catalog.pin(key)
        if evicted:
            metrics.EVICTIONS.inc(len(evicted))
            await self._announce_removed("evicted", evicted)
        return keys[:n]

    async def _follow_disk(self) -> None:
        """The catalog's capacity, from the file system's free space now (`disk_room.py`): its files on
        disk (those reserved and not yet written take no space yet) plus the room beyond the reserve."""
        unwritten = sum(self.catalog.size_of(key) for key in self._inflight)
        on_disk = self.catalog.used_bytes - unwritten
        loop = asyncio.get_running_loop()
        self.catalog.capacity_bytes = await loop.run_in_executor(
            self._executor, disk_capacity, self.store.root, on_disk, self.limits.min_free_bytes
        )
        metrics.STORE_CAPACITY_BYTES.set(self.catalog.capacity_bytes)

    async def _evict_for(self, file_bytes: int) -> list[int]:
        """Evict until `file_bytes` fit or nothing more can go (every entry pinned or a kept chain's)."""
        loop = asyncio.get_running_loop()
        evicted: list[int] = []
        rechecks_left = len(self.catalog)
        while not self.catalog.fits(file_bytes):
            popped = self.catalog.pop_lru()
            if popped is None:
                break
            key, entry = popped
            if self.limits.is_shared_root and rechecks_left > 0:
                rechecks_left -= 1
                mtime = await loop.run_in_executor(self._executor, self.store.mtime_s, *key)
                if mtime is None:
                    continue  # removed by another node already
                if mtime > entry.last_access_s + 1.0:  # read by another node since: keep it
                    self.catalog.add(key, entry.file_bytes, mtime, entry.parent)
                    continue
            await loop.run_in_executor(self._executor, self.store.remove, *key)
            evicted.append(key[1])
        return evicted

    async def drain(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))

    def close(self) -> None:
        self.segments.close()

"""The storage service of one node: block files <-> the node DRAM buffer, KV events, load reports.

Subjects: `storage.<node>.read` / `.write` (request/reply), `storage.<node>.control` (info, release,
cancel), and `abort` (cancels in-flight reads of the request). Events go to `kv.events.storage-<node>`
with location `store`.

Shared root (`is_shared_root`, e.g. several nodes on one 3FS/CephFS mount): every node reads every block
(location `store` means "readable by any storage service"); each node accounts only for the files it
wrote, so `capacity_bytes` is that node's share of the root and the root holds at most the sum of the
shares. Reads refresh a file's mtime, and before evicting a file a node re-checks its mtime: a file another
node read recently is kept (moved to the recent end) instead of deleted. Whoever deletes a file announces
BlockRemoved; the index treats `store` as one location, so any node's event updates it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from services.storage import metrics
from services.storage.block_store import BlockStore
from services.storage.config import StorageConfig
from services.storage.handlers import StorageHandlers
from services.storage.lru import LruCatalog
from services.storage.reader import BlockReader, ReaderLimits
from services.storage.token_bucket import TokenBucket
from services.storage.writer import BlockWriter, WriterLimits
from shared.errors import KvpathError
from shared.kvclient import KvEventPublisher
from shared.protocol import Abort, LoadReport
from shared.protocol.kv import (
    STORAGE_CONTROL_TYPES,
    TIER_STORE,
    StorageInfo,
    StorageReadRequest,
    StorageWriteRequest,
)
from shared.service import Service
from shared.shm import ShmSegment

log = logging.getLogger(__name__)

EVENT_CHUNK_BLOCKS = 4096
_LEASE_POLL_S = 0.1


class StorageService(Service):
    service_kind = "storage"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.config: StorageConfig = config
        self.buffer_name = config.buffer_name or f"kvpath-{config.namespace}-node{config.node}-buf"
        self.buffer_epoch = 0
        self.events = KvEventPublisher(self.bus, f"storage-{config.node}")
        self.store = BlockStore(config.root, node=config.node, fsync_policy=config.fsync_policy)
        self.catalog = LruCatalog(config.capacity_bytes)
        # reads queue on their own threads (their count is the read concurrency limit), so a busy read
        # path never delays writes and a finished read job hands its thread on without the event loop
        self._read_executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrent_reads, thread_name_prefix=f"storage{config.node}-read"
        )
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_concurrent_writes + 1, thread_name_prefix=f"storage{config.node}-io"
        )
        self._segment: ShmSegment | None = None
        self._reader: BlockReader | None = None
        self._writer: BlockWriter | None = None

    @property
    def reader(self) -> BlockReader:
        assert self._reader is not None, "storage service not started"
        return self._reader

    @property
    def writer(self) -> BlockWriter:
        assert self._writer is not None, "storage service not started"
        return self._writer

    # ------------------------------------------------------------------------------------- lifecycle

    async def on_start(self) -> None:
        found = await asyncio.get_running_loop().run_in_executor(self._executor, self._adopt_files)
        self._segment = ShmSegment.create(self.buffer_name, self.config.buffer_bytes, replace=True)
        self.buffer_epoch = time.time_ns()
        self._build_paths(self._segment)
        try:
            await self.events.start()
        except KvpathError as exc:  # keep serving reads and writes; events are counted as failed
            log.warning("KV events unavailable node=%s: %s", self.config.node, exc.message)
        info = StorageInfo(
            service_id=self.service_id,
            node=self.config.node,
            buffer_name=self.buffer_name,
            buffer_bytes=self.config.buffer_bytes,
            buffer_epoch=self.buffer_epoch,
        )
        handlers = StorageHandlers(self.reader, self.writer, info, self.report_load_now)
        subjects, c = self.bus.subjects, self.config
        await self.bus.subscribe(
            subjects.storage_read(c.node),
            StorageReadRequest,
            handlers.read,
            max_concurrency=2 * c.max_pending_reads,
        )
        await self.bus.subscribe(
            subjects.storage_write(c.node),
            StorageWriteRequest,
            handlers.write,
            max_concurrency=2 * c.max_pending_writes,
        )
        await self.bus.subscribe(subjects.storage_control(c.node), STORAGE_CONTROL_TYPES, handlers.control)
        await self.bus.subscribe(subjects.abort, Abort, handlers.abort)
        self.spawn(self._reap_leases(), "lease-reaper")
        if c.announce_on_start and found:
            self.spawn(self._announce_found(found), "announce-found")
        log.info(
            "storage node=%s root=%s blocks=%d used=%dB buffer=%s (%dB)",
            c.node, c.root, len(self.catalog), self.catalog.used_bytes, self.buffer_name, c.buffer_bytes,
        )  # fmt: skip

    def _build_paths(self, segment: ShmSegment) -> None:
        c = self.config
        self._reader = BlockReader(
            store=self.store,
            buffer_array=segment.array(),
            bucket=TokenBucket(c.bandwidth_bytes_per_s, c.burst_bytes),
            catalog=self.catalog,
            executor=self._read_executor,
            limits=ReaderLimits(
                c.max_concurrent_reads,
                c.max_pending_reads,
                c.max_blocks_per_request,
                c.lease_s,
                c.max_lease_s,
                verify_checksums=c.verify_checksums,
                touch_files=c.is_shared_root,
            ),
            report_bad=self._report_bad,
        )
        self._writer = BlockWriter(
            store=self.store,
            catalog=self.catalog,
            bucket=TokenBucket(c.write_bandwidth_bytes_per_s, c.burst_bytes),
            executor=self._executor,
            limits=WriterLimits(
                c.max_concurrent_writes,
                c.max_pending_writes,
                c.max_blocks_per_request,
                c.max_attached_segments,
                is_shared_root=c.is_shared_root,
                follows_disk=c.capacity_bytes == 0,
                min_free_bytes=c.min_free_bytes,
            ),
            announce_stored=self.announce_stored,
            announce_removed=self.announce_removed,
        )
        metrics.bind_queues(self._reader, self._writer)

    def _adopt_files(self) -> list[tuple[int, int]]:
        """Rebuild the LRU catalog from the files under root (own files only on a shared root)."""
        found = sorted(self.store.scan(only_own=self.config.is_shared_root), key=lambda b: b.mtime_s)
        for block in found:
            self.catalog.add((block.fingerprint_hash, block.block_hash), block.file_bytes, block.mtime_s)
        metrics.STORE_USED_BYTES.set(self.catalog.used_bytes)
        return [(b.fingerprint_hash, b.block_hash) for b in found]

    async def on_drain(self, deadline: float) -> None:
        if self._reader is not None:
            await self._reader.drain(deadline - time.monotonic())
        if self._writer is not None:
            await self._writer.drain(deadline - time.monotonic())

    async def on_stop(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._writer is not None:
            self._writer.close()
        self._read_executor.shutdown(wait=True, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._reader = self._writer = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    # ---------------------------------------------------------------------------------------- events

    async def announce_stored(self, hashes: list[int], parents: list[int], block_tokens: int) -> int:
        """Publish BlockStored (chunked); the last chunk's stream sequence, or 0 when the stream is down."""
        seq = 0
        for i in range(0, len(hashes), EVENT_CHUNK_BLOCKS):
            chunk = slice(i, i + EVENT_CHUNK_BLOCKS)
            try:
                seq = await self.events.stored(
                    TIER_STORE, hashes[chunk], parents[chunk], block_tokens=block_tokens
                )
            except KvpathError as exc:
                metrics.EVENT_ERRORS.inc()
                log.warning("BlockStored not published node=%s: %s", self.config.node, exc.message)
                return 0
        return seq

    async def announce_removed(self, reason: str, hashes: list[int]) -> None:
        for i in range(0, len(hashes), EVENT_CHUNK_BLOCKS):
            try:
                await self.events.removed(TIER_STORE, hashes[i : i + EVENT_CHUNK_BLOCKS], reason=reason)
            except KvpathError as exc:
                metrics.EVENT_ERRORS.inc()
                log.warning("BlockRemoved not published node=%s: %s", self.config.node, exc.message)
                return

    def _report_bad(self, reason: str, hashes: list[int]) -> None:
        """A read found blocks missing/corrupt/foreign (their files are already removed)."""
        metrics.BAD_BLOCKS.labels(reason).inc(len(hashes))
        log.warning("bad blocks on read node=%s reason=%s count=%d", self.config.node, reason, len(hashes))
        self.spawn(self.announce_removed(reason, hashes), f"removed-{reason}")

    async def _announce_found(self, found: list[tuple[int, int]]) -> None:
        await self.announce_stored([h for _, h in found], [], 0)

    # ------------------------------------------------------------------------------------------ loops

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(_LEASE_POLL_S)
            if self._reader is not None and self._reader.space.reap_expired(time.monotonic()):
                self.report_load_now()

    def load_report(self, seq: int) -> LoadReport | None:
        if self._reader is None or self._writer is None:
            return None
        reader = self._reader
        return LoadReport(
            service_id=self.service_id,
            role="storage",
            node=self.config.node,
            seq=seq,
            sent_at=time.time(),
            num_running=reader.num_pending,
            num_waiting=self._writer.num_pending,
            read_queue_tokens=reader.queue_tokens,
            read_queue_bytes=reader.queue_bytes,
            is_draining=self.status == "draining",
            rates={
                "read_bandwidth_bytes_per_s": self.config.bandwidth_bytes_per_s,
                "read_backlog_s": reader.bucket.backlog_s(asyncio.get_running_loop().time()),
                "buffer_free_bytes": float(reader.space.allocator.free_bytes),
                "store_used_bytes": float(self.catalog.used_bytes),
            },
        )

    def health(self) -> dict[str, Any]:
        out = super().health()
        out.update(
            node=self.config.node, root=self.config.root, blocks=len(self.catalog), buffer=self.buffer_name
        )
        return out

"""Read path: Full Block files -> the node buffer, under a bandwidth budget, leased to the request.

Blocks are read by I/O threads in runs of consecutive blocks (one job per run, at most
`max_concurrent_reads` jobs at once across all requests: the read executor's threads), each block with
preadv straight into its place in the mapped node buffer; a read is leased no sooner than the token bucket
allows. Only the verified leading blocks are leased; a bad block (missing, corrupt, foreign) ends the
prefix, is removed and reported. Cancelling a read (cancel message, abort, deadline) drops its queued jobs
and frees its extent once the I/O threads touching it are done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.storage import metrics
from services.storage.block_store import BlockStore, ReadOutcome
from services.storage.leases import Lease
from services.storage.lru import LruCatalog
from services.storage.node_buffer import NodeBuffer
from services.storage.token_bucket import TokenBucket
from shared.errors import AbortedError, DeadlineExceededError, InvalidRequestError, OverloadedError
from shared.hashing import fingerprint_seed
from shared.protocol.kv import StorageReadRequest

_U64_MAX = (1 << 64) - 1
_MAX_JOB_BYTES = 16 * 1024 * 1024  # one I/O-thread job reads at most this much (cancel granularity)
# ... and at least this much when the request has it: a job costs the event loop a hand-off to a thread and
# back (tens of us), which a few small blocks do not repay (Full Blocks of 512 KiB and up are unaffected;
# a lone request of small blocks on a cold disk reads with less parallelism)
_MIN_JOB_BYTES = 512 * 1024

BadBlockReporter = Callable[[str, list[int]], None]  # (reason, block hashes)
_Jobs = list[concurrent.futures.Future[list[ReadOutcome]]]


@dataclass(slots=True)
class _PendingRead:
    """A read's blocks not delivered yet: the node's read queue (`BlockReader.queue_tokens`), what DualPath's
    read-side choice compares. A block counts until the bandwidth budget has let it through, not only until
    the I/O thread has copied it (with the page cache warm that copy is near-instant, and a queue counted
    that way was empty while reads waited seconds for the budget: every read then went to the PE's side)."""

    request_id: str
    tokens_per_block: int
    bytes_per_block: int
    blocks_left: int


@dataclass(slots=True)
class ReaderLimits:
    max_concurrent_reads: int
    max_pending_reads: int
    max_blocks_per_request: int
    lease_s: float
    max_lease_s: float
    verify_checksums: bool = True
    touch_files: bool = False  # shared root: refresh mtimes so other nodes see the recency


class BlockReader:
    """Serves reads into the node buffer; `space` owns the buffer's extents and leases.

    `executor` runs this reader's jobs only: its `max_concurrent_reads` threads are the I/O concurrency limit.
    """

    def __init__(
        self,
        *,
        store: BlockStore,
        buffer_array: np.ndarray,
        bucket: TokenBucket,
        catalog: LruCatalog,
        executor: concurrent.futures.ThreadPoolExecutor,
        limits: ReaderLimits,
        report_bad: BadBlockReporter,
    ) -> None:
        self.store = store
        self.space = NodeBuffer(int(buffer_array.nbytes))
        self.bucket = bucket
        self.catalog = catalog
        self.limits = limits
        self._buffer = buffer_array.data
        self._executor = executor
        self._report_bad = report_bad
        self._pending: dict[int, _PendingRead] = {}
        self._tasks: dict[str, set[asyncio.Task[tuple[Lease | None, str]]]] = {}

    @property
    def queue_tokens(self) -> int:
        return sum(p.blocks_left * p.tokens_per_block for p in self._pending.values())

    @property
    def queue_bytes(self) -> int:
        return sum(p.blocks_left * p.bytes_per_block for p in self._pending.values())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ---------------------------------------------------------------------------------------- read

    async def read(self, req: StorageReadRequest) -> tuple[Lease | None, str]:
        """(lease of the verified leading blocks or None, miss reason). Raises on cancel or deadline."""
        self._validate(req)
        if len(self._pending) >= self.limits.max_pending_reads:
            raise OverloadedError(f"{len(self._pending)} reads pending on this node; retry later")
        num_blocks = min(len(req.block_hashes), self.space.usable_bytes // req.block_bytes)
        if num_blocks == 0:
            return None, "buffer_limit"
        pending = _PendingRead(req.request_id, req.block_tokens, req.block_bytes, num_blocks)
        self._pending[id(pending)] = pending
        metrics.READ_QUEUE_REQUESTS.inc()
        task = asyncio.create_task(self._run(req, num_blocks, pending), name=f"read:{req.request_id}")
        self._tasks.setdefault(req.request_id, set()).add(task)
        timed_out = False
        try:
            done, _ = await asyncio.wait({task}, timeout=req.timeout_s)
            timed_out = not done
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
            self._forget(req.request_id, task, pending)
        if not task.cancelled():
            return task.result()
        metrics.READS.labels("timeout" if timed_out else "cancelled").inc()
        if timed_out:
            raise DeadlineExceededError(f"read of {num_blocks} blocks not done within {req.timeout_s}s")
        raise AbortedError(f"read cancelled request_id={req.request_id}")

    def _forget(
        self, request_id: str, task: asyncio.Task[tuple[Lease | None, str]], pending: _PendingRead
    ) -> None:
        tasks = self._tasks.get(request_id)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[request_id]
        self._pending.pop(id(pending), None)
        metrics.READ_QUEUE_REQUESTS.dec()

    def _validate(self, req: StorageReadRequest) -> None:
        if not req.request_id or not req.fingerprint:
            raise InvalidRequestError("request_id and fingerprint must not be empty", param="request_id")
        if not 0 < len(req.block_hashes) <= self.limits.max_blocks_per_request:
            raise InvalidRequestError(
                f"a read names 1..{self.limits.max_blocks_per_request} blocks, got {len(req.block_hashes)}",
                param="block_hashes",
            )
        if any(not 0 <= h <= _U64_MAX for h in req.block_hashes):
            raise InvalidRequestError("block hashes are unsigned 64-bit integers", param="block_hashes")
        if req.block_bytes <= 0 or req.block_tokens < 0:
            raise InvalidRequestError("block_bytes must be > 0 and block_tokens >= 0", param="block_bytes")
        if req.timeout_s <= 0 or not 0 <= req.lease_s <= self.limits.max_lease_s:
            raise InvalidRequestError(
                f"timeout_s must be > 0 and lease_s in [0, {self.limits.max_lease_s}]", param="lease_s"
            )

    async def _run(
        self, req: StorageReadRequest, num_blocks: int, pending: _PendingRead
    ) -> tuple[Lease | None, str]:
        block_bytes = req.block_bytes
        offset = await self.space.allocate(num_blocks * block_bytes)
        jobs: _Jobs = []
        try:
            outcomes = await self._read_blocks(req, offset, num_blocks, pending, jobs)
        except BaseException:
            self.space.free_when_idle(offset, jobs)
            raise
        num_ok = next((i for i, o in enumerate(outcomes) if o is not ReadOutcome.OK), num_blocks)
        self._report(req, outcomes, num_ok)
        reason = ""
        if num_ok < num_blocks:
            first_bad = outcomes[num_ok]
            reason = first_bad.value if first_bad is not None else "cancelled"
        elif num_blocks < len(req.block_hashes):
            reason = "buffer_limit"
        if num_ok == 0:
            self.space.free(offset)
            return None, reason
        self.space.shrink(offset, num_ok * block_bytes)
        deadline_s = time.monotonic() + (req.lease_s or self.limits.lease_s)
        lease = Lease(uuid.uuid4().hex, req.request_id, offset, num_ok, block_bytes, deadline_s)
        self.space.lease(lease)
        return lease, reason

    def _report(self, req: StorageReadRequest, outcomes: list[ReadOutcome | None], num_ok: int) -> None:
        bad = [(o, req.block_hashes[i]) for i, o in enumerate(outcomes) if o not in (None, ReadOutcome.OK)]
        for bad_outcome in {o for o, _ in bad}:
            self._report_bad(bad_outcome.value, [h for o, h in bad if o is bad_outcome])
        metrics.READS.labels("hit" if num_ok == len(req.block_hashes) else "partial").inc()
        metrics.READ_BLOCKS.labels("ok").inc(num_ok)

    async def _read_blocks(
        self, req: StorageReadRequest, offset: int, num_blocks: int, pending: _PendingRead, jobs: _Jobs
    ) -> list[ReadOutcome | None]:
        """Read the blocks in runs, one I/O-thread job each, all queued at once; a bad block ends the prefix.

        The executor's `max_concurrent_reads` threads are the I/O concurrency limit: a thread that finishes a
        job takes the next queued one (of any request) without waiting for the event loop, which wakes once
        per read, when its last job is done. Jobs not started when the read is cancelled are dropped.
        """
        loop = asyncio.get_running_loop()
        fp_hash = fingerprint_seed(req.fingerprint)
        block_bytes = req.block_bytes
        outcomes: list[ReadOutcome | None] = [None] * num_blocks
        fan_out = -(-num_blocks // self.limits.max_concurrent_reads)
        per_job = max(1, min(max(fan_out, _MIN_JOB_BYTES // block_bytes), _MAX_JOB_BYTES // block_bytes))
        done_at = self.bucket.reserve(num_blocks * block_bytes, loop.time())
        runs = [req.block_hashes[i : min(i + per_job, num_blocks)] for i in range(0, num_blocks, per_job)]
        for start, hashes in zip(range(0, num_blocks, per_job), runs, strict=True):
            dest = self._buffer[offset + start * block_bytes : offset + (start + len(hashes)) * block_bytes]
            jobs.append(self._executor.submit(self._read_run_sync, fp_hash, hashes, dest, outcomes, start))
        try:
            await _all_done(jobs)
        finally:
            for job in jobs:
                job.cancel()  # only those still queued: a running job finishes its run
            read_bytes = [
                self._account(fp_hash, hashes, job.result(), block_bytes)
                if job.done() and not job.cancelled() and job.exception() is None
                else 0
                for hashes, job in zip(runs, jobs, strict=False)
            ]
        for job in jobs:
            job.result()  # an I/O error fails the read
        await self._deliver(runs, read_bytes, done_at, block_bytes, pending)
        return outcomes

    async def _deliver(
        self,
        runs: list[list[int]],
        read_bytes: list[int],
        done_at: float,
        block_bytes: int,
        pending: _PendingRead,
    ) -> None:
        """Let the read through at the budget's rate, run by run (the copies are done): each run leaves the
        node's read queue and counts as read bytes when the budget reaches it, so the queue DualPath's read
        side compares and the traffic the metrics show are a NIC's, not the page cache's instant copy."""
        loop = asyncio.get_running_loop()
        rate = self.bucket.rate_bytes_per_s
        start = done_at - sum(len(h) for h in runs) * block_bytes / rate if rate > 0 else loop.time()
        delivered = 0
        for hashes, nbytes in zip(runs, read_bytes, strict=True):
            delivered += len(hashes) * block_bytes
            at = start + delivered / rate if rate > 0 else start
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            metrics.READ_BYTES.inc(nbytes)
            pending.blocks_left -= len(hashes)

    def _account(
        self,
        fp_hash: int,
        hashes: list[int],
        results: list[ReadOutcome],
        block_bytes: int,
    ) -> int:
        """Refresh (or drop) the blocks' catalog entries; the payload bytes the job read."""
        now = time.time()  # tail first, so a chain's head is its most recent block (evicted last)
        for block_hash, outcome in reversed(list(zip(hashes, results, strict=False))):
            if outcome is ReadOutcome.OK:
                self.catalog.touch((fp_hash, block_hash), now)
            else:
                self.catalog.remove((fp_hash, block_hash))
        return len(results) * block_bytes

    def _read_run_sync(
        self,
        fp_hash: int,
        hashes: list[int],
        dest: memoryview,
        outcomes: list[ReadOutcome | None],
        start: int,
    ) -> list[ReadOutcome]:
        """In an I/O thread: read consecutive blocks into `dest`, stopping after the first bad one, and
        put their outcomes into `outcomes[start:]`. Reads nothing when an earlier block is already bad."""
        if any(o is not None and o is not ReadOutcome.OK for o in outcomes[:start]):
            return []
        out = self.store.read_run_into(fp_hash, hashes, dest, verify=self.limits.verify_checksums)
        outcomes[start : start + len(out)] = out  # one list operation: atomic under the GIL
        if self.limits.touch_files:
            for block_hash, outcome in zip(hashes, out, strict=False):
                if outcome is ReadOutcome.OK:
                    self.store.touch(fp_hash, block_hash)
        return out

    # --------------------------------------------------------------------------------------- cancel

    def cancel(self, request_id: str, *, drop_leases: bool) -> tuple[int, int]:
        """Cancel the request's reads (and drop its leases); return (reads cancelled, leases dropped)."""
        tasks = [t for t in self._tasks.get(request_id, ()) if not t.done()]
        for task in tasks:
            task.cancel()
        return len(tasks), self.space.release_request(request_id) if drop_leases else 0

    async def drain(self, timeout_s: float) -> None:
        tasks = {t for ts in self._tasks.values() for t in ts}
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, timeout_s))

    def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        self._buffer = memoryview(b"")


def _all_done(jobs: _Jobs) -> asyncio.Future[None]:
    """A future of the running loop, set once every job is done (one loop wake per read, not per job)."""
    loop = asyncio.get_running_loop()
    all_done: asyncio.Future[None] = loop.create_future()
    left = [len(jobs)]
    lock = threading.Lock()  # done callbacks run in the I/O threads

    def one_done(_job: object) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        loop.call_soon_threadsafe(_resolve, all_done)

    for job in jobs:
        job.add_done_callback(one_done)
    return all_done


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # not cancelled meanwhile
        future.set_result(None)

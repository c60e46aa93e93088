"""The writer's event order under eviction: a block is never announced removed before it is announced
stored (the index would then keep a block that is gone; seen as a flaky mismatch of index and disk with
concurrent writers past capacity). The BlockStored publication is held back by a test hook: a slow
JetStream acknowledgement is the fault, which a real nats-server does not produce on demand."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from services.storage.block_store import BlockStore
from services.storage.lru import LruCatalog
from services.storage.token_bucket import TokenBucket
from services.storage.writer import BlockWriter, WriterLimits
from shared.errors import StorageError, StorageFullError
from shared.hashing import fingerprint_seed
from shared.protocol.kv import StorageWriteRequest
from shared.shm import ShmSegment

BLOCK_BYTES = 4096
FP = "fp-writer-order"


@pytest.fixture
def segment() -> ShmSegment:
    seg = ShmSegment.create(f"kvpath-test-writer-{os.getpid()}", 4 * BLOCK_BYTES, replace=True)
    np.frombuffer(seg.buf, dtype=np.uint8)[:] = 7
    yield seg
    seg.close()
    seg.path.unlink(missing_ok=True)


def _request(segment: ShmSegment, hashes: Sequence[int], request_id: str) -> StorageWriteRequest:
    return StorageWriteRequest(
        request_id=request_id,
        fingerprint=FP,
        segment_name=segment.name,
        offsets=[i * BLOCK_BYTES for i in range(len(hashes))],
        block_bytes=BLOCK_BYTES,
        block_hashes=list(hashes),
        parent_hashes=[0] * len(hashes),
        timeout_s=10.0,
    )


async def test_a_block_is_not_evicted_before_it_is_announced(segment: ShmSegment, tmp_path: Path) -> None:
    events: list[tuple[str, int]] = []
    release_stored = asyncio.Event()
    stored_called = asyncio.Event()

    async def announce_stored(hashes: Sequence[int], parents: Sequence[int], block_tokens: int) -> int:
        stored_called.set()
        await release_stored.wait()  # the held-back acknowledgement
        events.extend(("stored", h) for h in hashes)
        return 1

    async def announce_removed(reason: str, hashes: Sequence[int]) -> int:
        events.extend(("removed", h) for h in hashes)
        return 1

    store = BlockStore(tmp_path, node=0)
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        writer = _writer(store, executor, 4, announce_stored, announce_removed)
        first = asyncio.create_task(writer.write(_request(segment, [11], "a")))
        await asyncio.wait_for(stored_called.wait(), 10)  # block 11 is written, its event not yet out
        key = (fingerprint_seed(FP), 11)
        file_bytes = writer.catalog.used_bytes
        assert key in writer.catalog and file_bytes > 0
        writer.catalog.capacity_bytes = file_bytes  # room for one block: the next write must evict
        with pytest.raises(StorageFullError):  # 11 is pinned until announced: nothing can go
            await writer.write(_request(segment, [22], "b"))
        release_stored.set()
        await asyncio.wait_for(first, 10)
        await asyncio.wait_for(writer.write(_request(segment, [33], "c")), 10)  # now 11 may go
        writer.close()
    assert events == [("stored", 11), ("removed", 11), ("stored", 33)]


async def test_a_block_two_requests_write_at_once_is_announced_only_once_its_file_exists(
    segment: ShmSegment, tmp_path: Path
) -> None:
    """One I/O slot, its thread held by the test: request b has reserved block 2 and waits for the slot
    when request c asks to write block 2 too. c must wait for b's file, not announce it at once (the index
    would then send readers to a file not written yet: seen as `missing` reads under 150 concurrent chats
    sharing a system prompt)."""
    store = BlockStore(tmp_path, node=0)
    announced_early: list[int] = []
    fp_hash = fingerprint_seed(FP)

    async def announce_stored(hashes: Sequence[int], parents: Sequence[int], block_tokens: int) -> int:
        announced_early.extend(h for h in hashes if not store.exists(fp_hash, h, BLOCK_BYTES))
        return 1

    async def announce_removed(reason: str, hashes: Sequence[int]) -> int:
        return 1

    held = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        executor.submit(held.wait, 10)  # the one I/O thread is busy: a's write queues behind it
        writer = _writer(store, executor, 1, announce_stored, announce_removed)
        a = asyncio.create_task(writer.write(_request(segment, [1], "a")))
        await _until(lambda: (fp_hash, 1) in writer._writing)  # a holds the I/O slot
        b = asyncio.create_task(writer.write(_request(segment, [2], "b")))
        await _until(lambda: (fp_hash, 2) in writer.catalog)  # b reserved block 2, waits for the slot
        c = asyncio.create_task(writer.write(_request(segment, [2], "c")))
        done, _ = await asyncio.wait([c], timeout=0.2)
        assert not done  # c waits for b's write of block 2
        held.set()
        replies = await asyncio.wait_for(asyncio.gather(a, b, c), 10)
        writer.close()
    assert announced_early == []
    assert [(r.num_written, r.num_existing) for r in replies] == [(1, 0), (1, 0), (0, 1)]


async def test_a_write_cancelled_before_its_io_leaves_no_reservation(
    segment: ShmSegment, tmp_path: Path
) -> None:
    """A request that times out while its blocks wait for an I/O slot: their reservations go with it (the
    catalog would otherwise count, pin and announce as existing files that were never written)."""
    store = BlockStore(tmp_path, node=0)

    async def announce(*args: object) -> int:
        return 1

    held = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        executor.submit(held.wait, 10)
        writer = _writer(store, executor, 1, announce, announce)
        a = asyncio.create_task(writer.write(_request(segment, [1], "a")))
        await _until(lambda: (fingerprint_seed(FP), 1) in writer._writing)  # a holds the I/O slot
        short = dataclasses.replace(_request(segment, [2], "b"), timeout_s=0.05)
        with pytest.raises(StorageError):
            await writer.write(short)
        assert (fingerprint_seed(FP), 2) not in writer.catalog
        held.set()
        await asyncio.wait_for(a, 10)
        again = await asyncio.wait_for(writer.write(_request(segment, [2], "c")), 10)
        writer.close()
    assert (again.num_written, again.num_existing) == (1, 0)
    assert store.exists(fingerprint_seed(FP), 2, BLOCK_BYTES)


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Yield to the loop until `condition` holds (the writer's own state), failing past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


def _writer(
    store: BlockStore,
    executor: concurrent.futures.ThreadPoolExecutor,
    io_slots: int,
    announce_stored: Callable[..., Awaitable[int]],
    announce_removed: Callable[..., Awaitable[int]],
) -> BlockWriter:
    """A writer over `store` with no capacity limit and no bandwidth cap, `io_slots` writes at once."""
    return BlockWriter(
        store=store,
        catalog=LruCatalog(capacity_bytes=0),
        bucket=TokenBucket(0),
        executor=executor,
        limits=WriterLimits(io_slots, 16, 16, 4),
        announce_stored=announce_stored,
        announce_removed=announce_removed,
    )

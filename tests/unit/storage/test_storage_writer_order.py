"""The writer's event order under eviction: a block is never announced removed before it is announced
stored (the index would then keep a block that is gone; seen as a flaky mismatch of index and disk with
concurrent writers past capacity). The BlockStored publication is held back by a test hook: a slow
JetStream acknowledgement is the fault, which a real nats-server does not produce on demand."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from services.storage.block_store import BlockStore
from services.storage.lru import LruCatalog
from services.storage.token_bucket import TokenBucket
from services.storage.writer import BlockWriter, WriterLimits
from shared.errors import StorageFullError
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
        writer = BlockWriter(
            store=store,
            catalog=LruCatalog(capacity_bytes=0),
            bucket=TokenBucket(0),
            executor=executor,
            limits=WriterLimits(4, 16, 16, 4),
            announce_stored=announce_stored,
            announce_removed=announce_removed,
        )
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

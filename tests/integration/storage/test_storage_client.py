"""StorageClient / IndexClient edge cases: services down, staging limits, write deadlines, bad arguments."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from shared.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    ServiceUnavailableError,
)
from shared.kvclient import IndexClient, KvEventPublisher, StorageClient
from shared.shm import ShmSegment, segment_path
from tests.integration.storage.storage_harness import (
    FP,
    LAYOUT,
    StorageCluster,
    chain,
    wait_for,
    write_blocks,
)


async def test_services_down_raise_service_unavailable(cluster: StorageCluster) -> None:
    bus = await cluster.bus("engine")
    client = StorageClient(bus, 7, LAYOUT, FP, staging_bytes=1 << 20)
    await client.start()  # storage not up yet: start still succeeds (the buffer is mapped later)
    try:
        hashes, parents = chain(2)
        with pytest.raises(ServiceUnavailableError):
            await client.read("r", hashes, deadline_s=1.0)
        staged = client.stage(2)
        with pytest.raises(ServiceUnavailableError):
            await client.write(staged, hashes, parents)
        assert client._staging_alloc is not None and client._staging_alloc.used_bytes == 0  # freed
        with pytest.raises(ServiceUnavailableError):
            await IndexClient(bus).match(hashes)
        assert (await IndexClient(bus).match([])).num_hit_blocks == 0  # nothing to ask
    finally:
        await client.close()


async def test_staging_limits_and_argument_checks(cluster: StorageCluster) -> None:
    node = await cluster.start()
    client = node.client
    whole = client.staging_bytes // LAYOUT.full_block_bytes
    staged = client.stage(whole)
    with pytest.raises(OverloadedError, match="staging segment full"):
        client.stage(1)
    client.unstage(staged)
    client.unstage(staged)  # idempotent
    staged = client.stage(2)
    hashes, parents = chain(3)
    with pytest.raises(InvalidRequestError, match="2 staged blocks, 3 hashes"):
        await client.write(staged, hashes, parents)
    client.unstage(staged)
    with pytest.raises(InvalidRequestError, match="seconds from now"):
        await client.read("r", hashes, deadline_s=1.7e9)  # an absolute time by mistake
    empty = await client.read("r", [], deadline_s=1.0)
    assert empty.num_blocks == 0 and empty.views.shape == (0, *LAYOUT.shape)


async def test_write_deadline_keeps_staging_until_the_service_is_done(cluster: StorageCluster) -> None:
    node = await cluster.start(write_bandwidth_bytes_per_s=20_000.0)  # ~1 s per 16 KiB block
    hashes, parents = chain(2)
    staged = node.client.stage(2)
    with pytest.raises(DeadlineExceededError):
        await node.client.write(staged, hashes, parents, timeout_s=0.3)
    alloc = node.client._staging_alloc
    assert alloc is not None and alloc.used_bytes > 0  # quarantined: the service may still read it
    await wait_for(lambda: alloc.used_bytes == 0, 5.0, "the quarantined staging space to be freed")


async def test_writes_refused_by_a_full_queue_are_sent_again_and_all_land(cluster: StorageCluster) -> None:
    """One write at a time on the node (~0.1 s each): four sent at once are refused three times over
    (the queue holds one), and each lands once its turn comes, with the bytes it staged."""
    node = await cluster.start(max_pending_writes=1, write_bandwidth_bytes_per_s=160_000.0)
    chains = [chain(1, seed=i) for i in range(4)]
    written = await asyncio.gather(
        *(write_blocks(node.client, h, p, seed=i) for i, (h, p) in enumerate(chains))
    )
    for i, (hashes, _) in enumerate(chains):
        async with await node.client.read(f"r{i}", hashes, deadline_s=5.0) as lease:
            assert lease.num_blocks == 1 and np.array_equal(lease.views, written[i])
    alloc = node.client._staging_alloc
    assert alloc is not None and alloc.used_bytes == 0


async def test_a_write_still_refused_at_its_deadline_fails_and_frees_its_staging(
    cluster: StorageCluster,
) -> None:
    node = await cluster.start(max_pending_writes=1, write_bandwidth_bytes_per_s=20_000.0)  # ~1 s a block
    slow_hashes, slow_parents = chain(1, seed=1)
    slow = asyncio.create_task(write_blocks(node.client, slow_hashes, slow_parents))
    alloc = node.client._staging_alloc
    assert alloc is not None
    await wait_for(lambda: node.service.writer.num_pending == 1, 5.0, "the slow write to be queued")
    held = alloc.used_bytes
    hashes, parents = chain(1, seed=2)
    staged = node.client.stage(1)
    started = time.monotonic()
    with pytest.raises(OverloadedError, match="writes pending"):
        await node.client.write(staged, hashes, parents, timeout_s=0.3)
    assert 0.1 <= time.monotonic() - started < 0.6  # asked again (20, 40, 80 ms later), not past the deadline
    assert alloc.used_bytes == held  # its own staging space is free again
    await slow


async def test_event_publisher_converts_numpy_hashes_and_orders_events(cluster: StorageCluster) -> None:
    bus = await cluster.bus("publisher")
    pub = KvEventPublisher(bus, "engine-x")
    await pub.start()
    await pub.start()  # the stream exists: idempotent
    hashes = np.array([1, 2**64 - 1], dtype=np.uint64)
    seqs = [await pub.stored("hbm:engine-x", hashes), await pub.removed("hbm:engine-x", hashes[:1])]
    seqs.append(await pub.cleared(["hbm:engine-x"], reason="restart"))
    assert seqs == sorted(seqs) and len(set(seqs)) == 3


async def test_read_after_storage_restart_remaps_the_new_buffer(cluster: StorageCluster) -> None:
    first = await cluster.start(service_id="storage-first")
    hashes, parents = chain(2)
    data = await write_blocks(first.client, hashes, parents)
    async with await first.client.read("r1", hashes, deadline_s=5.0) as lease:
        assert np.array_equal(lease.views, data)
    await first.service.stop()  # the buffer segment is unlinked
    second = await cluster.start(service_id="storage-second")
    assert second.service.buffer_epoch != first.service.buffer_epoch
    async with await first.client.read("r2", hashes, deadline_s=5.0) as lease:  # the old client remaps
        assert np.array_equal(lease.views, data)


async def test_named_staging_segment_replaces_a_crashed_owners(cluster: StorageCluster) -> None:
    node = await cluster.start()
    bus = await cluster.bus("engine-restarted")
    stale = ShmSegment.create(f"kvpath-{cluster.namespace}-stage-engine-9", 4096)  # left by a crash
    client = StorageClient(bus, 0, LAYOUT, FP, staging_bytes=1 << 20, owner_id="engine-9")
    await client.start()
    try:
        assert (
            client._staging is not None
            and client._staging.name == stale.name
            and client._staging.size == 1 << 20
        )
        hashes, parents = chain(2, seed=4)
        await write_blocks(client, hashes, parents)
        assert (await node.client.read("r", hashes, deadline_s=5.0)).num_blocks == 2
    finally:
        await client.close()
        stale.close()
    assert not segment_path(stale.name).exists()

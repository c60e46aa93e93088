"""Storage limits for real: bandwidth budget, read queue in load reports, cancel, leases, capacity."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.index.config import IndexConfig
from services.index.service import IndexService
from services.storage.lru import LruCatalog
from shared.blocks import BlockLayout
from shared.bus import MsgContext
from shared.errors import AbortedError, StorageFullError
from shared.hashing import block_hashes, block_parents, fingerprint_seed
from shared.kvclient import IndexClient
from shared.protocol import Abort, LoadReport
from shared.protocol.kv import BlockRemoved
from tests.integration.storage.storage_harness import (
    FP,
    LAYOUT,
    StorageCluster,
    chain,
    stream_events,
    wait_for,
    write_blocks,
)

BIG = BlockLayout(num_layers=4, block_size=16, bytes_per_token_layer=1024)  # 64 KiB Full Blocks


def disk_blocks(root: Path) -> tuple[set[int], int]:
    files = list(root.rglob("*.blk"))
    return {int(p.name[:-4], 16) for p in files}, sum(p.stat().st_size for p in files)


def catalog_keys(catalog: LruCatalog) -> set[int]:
    return {key[1] for key in catalog._entries}


def _big_chain(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    hashes = block_hashes([seed * 100_000 + i for i in range(n * BIG.block_size)], BIG.block_size, FP)
    return hashes, block_parents(hashes, FP)


async def test_bandwidth_budget_holds_and_load_reports_the_queue(cluster: StorageCluster) -> None:
    rate = 8e6  # bytes/s
    node = await cluster.start(layout=BIG, bandwidth_bytes_per_s=rate, buffer_bytes=32 << 20)
    chains = [_big_chain(80, seed) for seed in range(4)]  # 320 blocks, 21 MB: ~2.6 s at the budget
    for hashes, parents in chains:
        await write_blocks(node.client, hashes, parents)
    reports: list[LoadReport] = []
    received: list[float] = []

    async def on_report(msg: LoadReport, ctx: MsgContext) -> None:
        reports.append(msg)
        received.append(time.monotonic())

    bus = node.client.bus
    await bus.subscribe(bus.subjects.load("storage", node.service.service_id), LoadReport, on_report)
    await bus.flush()
    started = time.monotonic()
    leases = await asyncio.gather(
        *(node.client.read(f"bw-{i}", hashes, deadline_s=30.0) for i, (hashes, _) in enumerate(chains))
    )
    elapsed = time.monotonic() - started
    total = sum(lease.num_blocks for lease in leases) * BIG.full_block_bytes
    assert total == 320 * BIG.full_block_bytes and elapsed >= 1.0
    assert total / elapsed == pytest.approx(rate, rel=0.10)
    busy = [r for r in reports if r.read_queue_bytes > 0]
    assert busy and max(r.read_queue_tokens for r in busy) >= 80 * BIG.block_size
    # the queue holds what the budget has not let through yet, however fast the page cache copied it: every
    # report well inside the reads' 2.6 s shows blocks queued (DualPath's read side compares these queues)
    during = (started + 0.3, started + elapsed - 0.5)
    inside = [r for r, t in zip(reports, received, strict=True) if during[0] < t < during[1]]
    assert len(inside) >= 2 and all(r.read_queue_tokens >= BIG.block_size for r in inside)
    assert all(r.role == "storage" and r.node == 0 for r in reports)
    for lease in leases:
        await lease.release()
    await wait_for(lambda: bool(reports) and reports[-1].read_queue_bytes == 0, 3.0, "an idle load report")


async def test_cancel_and_abort_free_the_buffer(cluster: StorageCluster) -> None:
    node = await cluster.start(layout=BIG, bandwidth_bytes_per_s=1e6, buffer_bytes=32 << 20)
    hashes, parents = _big_chain(60)  # 60 s at this budget: only a cancel ends it
    await write_blocks(node.client, hashes, parents)
    reader = node.service.reader
    read = asyncio.create_task(node.client.read("slow", hashes, deadline_s=60.0))
    await wait_for(lambda: reader.space.used_bytes > 0, 5.0, "the read to start")
    await node.client.cancel("slow")
    with pytest.raises(AbortedError):
        await read
    await wait_for(lambda: reader.space.used_bytes == 0 and reader.num_pending == 0, 5.0, "space freed")
    # the same through the shared abort subject
    read = asyncio.create_task(node.client.read("slow-2", hashes, deadline_s=60.0))
    await wait_for(lambda: reader.space.used_bytes > 0, 5.0, "the second read to start")
    await node.client.bus.publish(node.client.bus.subjects.abort, Abort(request_id="slow-2", reason="test"))
    with pytest.raises(AbortedError):
        await read
    await wait_for(lambda: reader.space.used_bytes == 0, 5.0, "space freed after abort")


async def test_lease_expiry_reclaims_space_and_waiting_reads_get_it(cluster: StorageCluster) -> None:
    # the buffer holds 4 blocks of 16 KiB: a second read must wait for the first lease to go
    node = await cluster.start(buffer_bytes=4 * LAYOUT.full_block_bytes)
    hashes, parents = chain(4)
    await write_blocks(node.client, hashes, parents)
    held = await node.client.read("holder", hashes, deadline_s=5.0, lease_s=0.5)
    assert held.num_blocks == 4
    started = time.monotonic()
    second = await node.client.read("waiter", hashes, deadline_s=10.0)  # the holder never releases
    assert second.num_blocks == 4 and time.monotonic() - started >= 0.3
    assert len(node.service.reader.space.leases) == 1
    await second.release()
    # more blocks than the buffer can ever hold: the leading blocks that fit
    more, more_parents = chain(6, seed=9)
    await write_blocks(node.client, more, more_parents)
    capped = await node.client.read("capped", more, deadline_s=5.0)
    assert capped.num_blocks == 4 and capped.miss_reason == "buffer_limit"
    await capped.release()


async def test_lru_eviction_takes_chain_tails_is_announced_and_the_index_forgets(
    cluster: StorageCluster,
) -> None:
    file_bytes = LAYOUT.full_block_bytes + 64
    node = await cluster.start(capacity_bytes=4 * file_bytes)
    index = IndexService(
        IndexConfig(nats_url=cluster.server.url, namespace=cluster.namespace, fetch_wait_s=0.1)
    )
    await index.start()
    try:
        client, index_client = node.client, IndexClient(node.client.bus)
        a, a_parents = chain(3, seed=1)
        b, b_parents = chain(3, seed=2)
        await write_blocks(client, a, a_parents)
        await write_blocks(client, b[:1], b_parents[:1])
        lease = await client.read("touch", a[:1], deadline_s=5.0)  # A's head becomes the most recent
        await lease.release()
        result = await client.write(client.stage(2), b[1:], b_parents[1:])  # two more: two must go
        await index_client.wait_applied(result.event_stream_seq, timeout_s=5.0)
        store = node.service.store
        present = [store.path_for(fingerprint_seed(FP), h).exists() for h in a + b]
        assert present == [True, False, False, True, True, True]  # A lost its tail, never its head
        removed = [e for e in await stream_events(client.bus) if isinstance(e, BlockRemoved)]
        assert [h for e in removed for h in e.block_hashes] == [a[2], a[1]]  # tail first
        assert all(e.reason == "evicted" for e in removed)
        assert (await index_client.match(a)).num_hit_blocks == 1
        assert (await index_client.match(b)).per_tier == {"store": 3}
    finally:
        await index.stop()


async def test_concurrent_writers_past_capacity_keep_catalog_index_and_disk_equal(
    cluster: StorageCluster,
) -> None:
    """Many writers at once past a small capacity (the issue: 20 files on disk, 15 accounted, 185 indexed):
    afterwards the catalog, the files under the root and the index agree exactly, within capacity."""
    file_bytes = LAYOUT.full_block_bytes + 64
    node = await cluster.start(capacity_bytes=6 * file_bytes)
    index = IndexService(
        IndexConfig(nats_url=cluster.server.url, namespace=cluster.namespace, fetch_wait_s=0.1)
    )
    await index.start()
    try:
        client = node.client
        chains = [chain(3, seed=10 + i) for i in range(12)]
        for round_ in range(3):  # overlapping chains across rounds: existing blocks, evictions, new ones
            picked = chains[round_ * 3 : round_ * 3 + 6]
            results = await asyncio.gather(
                *(write_blocks(client, h, p) for h, p in picked), return_exceptions=True
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            assert all(isinstance(r, StorageFullError) for r in failed), failed
        catalog = node.service.catalog
        on_disk, disk_bytes = disk_blocks(Path(node.service.config.root))  # what `ls` shows
        assert len(catalog) == len(on_disk) and catalog.used_bytes == disk_bytes
        assert catalog.used_bytes <= 6 * file_bytes
        index_client = IndexClient(client.bus)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:  # the index applies the stream's events a moment later: wait for it, with a deadline
            indexed = {
                h for hashes, _ in chains for h in hashes if (await index_client.match([h])).num_hit_blocks
            }
            if indexed == on_disk or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert indexed == on_disk and catalog_keys(catalog) == on_disk
    finally:
        await index.stop()


async def test_capacity_survives_a_restart(cluster: StorageCluster, tmp_path: Path) -> None:
    file_bytes = LAYOUT.full_block_bytes + 64
    first = await cluster.start(capacity_bytes=3 * file_bytes, service_id="storage-a")
    hashes, parents = chain(4)
    await write_blocks(first.client, hashes[:3], parents[:3])
    await first.service.stop()
    second = await cluster.start(capacity_bytes=3 * file_bytes, service_id="storage-b")
    assert len(second.service.catalog) == 3  # adopted from the files on disk
    await write_blocks(second.client, hashes[3:], parents[3:])
    assert len(second.service.catalog) == 3 and second.service.catalog.used_bytes == 3 * file_bytes


async def test_storage_full_is_a_clear_write_error(tiny_fs: Path, cluster: StorageCluster) -> None:
    node = await cluster.start(capacity_bytes=LAYOUT.full_block_bytes // 2)
    hashes, parents = chain(1)
    with pytest.raises(StorageFullError, match="storage full"):
        await write_blocks(node.client, hashes, parents)
    assert node.client._staging_alloc is not None and node.client._staging_alloc.used_bytes == 0
    # the disk itself filling up (a real 128 KiB tmpfs) is reported the same way
    tiny = await cluster.start(1, root=str(tiny_fs))
    many, many_parents = chain(12, seed=3)
    with pytest.raises(StorageFullError, match="storage full"):
        await write_blocks(tiny.client, many, many_parents)
    # what did get written is durable and readable; the service keeps serving
    lease = await tiny.client.read("after-full", many, deadline_s=5.0)
    assert 0 < lease.num_blocks < 12
    await lease.release()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real file system of 512 KiB (tmpfs): a disk that fills up, as a misjudged volume does."""
    root = tmp_path / "small"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


async def test_without_a_capacity_a_full_disk_evicts_instead_of_failing_every_write(
    cluster: StorageCluster, small_disk: Path
) -> None:
    """`capacity_bytes` 0 on a disk of ~25 block files: before, the 26th write failed as storage full and
    every later one too, the first blocks kept forever; now the disk's free room (less `min_free_bytes`) is
    the capacity, and new chains evict the least recently used ones, announced as BlockRemoved."""
    node = await cluster.start(root=str(small_disk / "root"), min_free_bytes=64 * 1024)
    chains = [chain(3, seed=100 + i) for i in range(16)]  # 48 blocks of 16 KiB into 512 KiB
    for hashes, parents in chains:
        await write_blocks(node.client, hashes, parents)
    on_disk, _ = disk_blocks(small_disk / "root")
    assert set(chains[-1][0]) <= on_disk and not set(chains[0][0]) & on_disk  # newest kept, oldest gone
    assert catalog_keys(node.service.catalog) == on_disk
    removed = [
        h for e in await stream_events(node.client.bus) if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert set(chains[0][0]) <= set(removed)

"""The remote tier's read and write paths against an in-process store (the real slot table) and a numpy KV
cache: bytes round-trip across engines layer by layer, failures are misses, pins guard eviction."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from services.engine.remote_tier import RemoteTier
from services.remotekv.slot_table import SlotTable
from shared.blocks import BlockLayout
from shared.errors import ConfigError, DeadlineExceededError, KvpathError, ServiceUnavailableError
from shared.hashing import block_hashes
from shared.protocol.kv import RemoteKvCommitReply, RemoteKvGetReply, RemoteKvPutReply, RemoteKvTarget

LAYOUT = BlockLayout(num_layers=3, block_size=4, bytes_per_token_layer=8)  # 96-byte blocks
CB = 4  # blocks per super block
CHUNK_BYTES = CB * LAYOUT.full_block_bytes


class FakeStore:
    """Stands in for `RemoteStoreClient`: the store's slot table and region live in this process."""

    def __init__(self, num_slots: int = 8) -> None:
        self.table = SlotTable(num_slots * 4096)
        self.table.adopt("fp", CHUNK_BYTES)
        self.region = np.zeros(self.table.region_bytes(), dtype=np.uint8)
        self.arenas: dict[str, np.ndarray] = {}  # engine id -> its cache region (GETs land there)
        self.timeout_s = 0.05
        self.sender = SimpleNamespace(register_memory=lambda data: None)
        self.down: KvpathError | None = None
        self.hangs = False
        self.delay_s = 0.0  # a GET that takes this long, then lands
        self.num_gets = 0
        self.failures: list[str] = []

    async def link(self) -> str:
        if self.down is not None:
            raise self.down
        return "link"

    async def put(self, link: str, request_id: str, keys: list[int]) -> RemoteKvPutReply:
        r = self.table.reserve(keys, now_s=time.monotonic(), ttl_s=10)
        return RemoteKvPutReply(epoch=1, put_id=r.put_id, offsets=r.offsets, outcomes=r.outcomes)

    async def write(self, link: str, pieces: list[tuple[int, np.ndarray]]) -> None:
        for offset, data in pieces:
            self.region[offset : offset + data.size] = data

    async def commit(
        self, put_id: int, keys: list[int], checksums: list[int] | None = None
    ) -> RemoteKvCommitReply:
        committed, released = self.table.commit(put_id, keys, checksums or ())
        return RemoteKvCommitReply(num_committed=committed, num_released=released)

    async def get(
        self, link: str, request_id: str, keys: list[int], target: RemoteKvTarget, timeout_s: float
    ) -> RemoteKvGetReply:
        self.num_gets += 1
        if self.hangs:
            await asyncio.sleep(timeout_s)
            raise DeadlineExceededError("no reply")
        await asyncio.sleep(self.delay_s)
        offsets = self.table.pin_prefix(keys)
        arena = self.arenas[target.engine_id]
        for src, dst in zip(offsets, target.offsets, strict=False):
            arena[dst : dst + CHUNK_BYTES] = self.region[src : src + CHUNK_BYTES]
        self.table.unpin(keys[: len(offsets)])
        checksums = self.table.checksums(keys[: len(offsets)])
        return RemoteKvGetReply(epoch=1, num_hit_chunks=len(offsets), checksums=checksums)

    def failed(self, exc: KvpathError) -> None:
        self.failures.append(exc.code)

    async def close(self) -> None:
        pass


class FakeReceiver:
    def __init__(self) -> None:
        self.regions: dict[str, np.ndarray] = {}

    def register_region(self, name: str, size_bytes: int) -> Any:
        self.regions[name] = np.zeros(size_bytes, dtype=np.uint8)
        return SimpleNamespace(array=lambda: self.regions[name])

    def endpoint(self) -> dict[str, Any]:
        return {}

    def unregister_region(self, name: str) -> None:
        del self.regions[name]


class FakeAnnouncer:
    def __init__(self) -> None:
        self.stored: list[int] = []  # block hashes announced
        self.removed: list[int] = []

    async def start(self) -> None:
        pass

    async def stored_(self, entries: Any, *, wait_applied: bool = False) -> None:
        self.stored += [h for e in entries for h in e.block_hashes]

    async def removed_(self, entries: Any) -> None:
        self.removed += [h for e in entries for h in e.block_hashes]

    async def close(self) -> None:
        pass


class FakeKv:
    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.blocks = rng.integers(0, 256, (num_blocks, *LAYOUT.shape), dtype=np.uint8)

    def export_blocks(self, block_ids: list[int], out: np.ndarray) -> None:
        out[:] = self.blocks[block_ids]

    def import_layer(self, block_ids: list[int], layer: int, src: np.ndarray) -> None:
        self.blocks[block_ids, layer] = src


def tier(
    store: FakeStore, kv: FakeKv, engine_id: str, cache_chunks: int = 4, *, verify: bool = True
) -> RemoteTier:
    announcer = FakeAnnouncer()
    t = RemoteTier(
        store,  # type: ignore[arg-type]
        FakeReceiver(),  # type: ignore[arg-type]
        SimpleNamespace(  # type: ignore[arg-type]
            start=announcer.start, stored=announcer.stored_, removed=announcer.removed_, close=announcer.close
        ),
        LAYOUT,
        kv,
        engine_id=engine_id,
        seed=1,
        chunk_blocks=CB,
        cache_bytes=cache_chunks * CHUNK_BYTES + 10,
        verify_checksums=verify,
    )
    t.announced = announcer  # type: ignore[attr-defined]
    store.arenas[engine_id] = t.arena
    return t


def sequence(tokens: list[int], block_ids: list[int]) -> Any:
    hashes = block_hashes(tokens, LAYOUT.block_size, "fp")
    return SimpleNamespace(
        block_hashes=hashes,
        block_ids=block_ids,
        request_id="r",
        deadline_unix_s=time.time() + 60,
        plan=SimpleNamespace(kv=SimpleNamespace(salt=0)),
    )


def import_all(t: RemoteTier, read: Any, kv_ids: list[int]) -> None:
    for layer in range(LAYOUT.num_layers):
        t.import_layer(kv_ids, read, layer)


async def test_written_super_blocks_come_back_on_another_engine_layer_by_layer() -> None:
    store = FakeStore()
    kv_a, kv_b = FakeKv(12, seed=1), FakeKv(12, seed=2)
    a, b = tier(store, kv_a, "engine-a"), tier(store, kv_b, "engine-b")
    src_ids = [3, 1, 4, 0, 5, 9, 2, 6, 8]  # 9 full blocks: 2 whole super blocks
    seq = sequence(list(range(37)), src_ids)
    done = a.write(seq, 0, 9, 1)
    assert done is not None
    await done
    assert store.table.num_committed == 2 and a.announced.stored == seq.block_hashes[:8]  # type: ignore[attr-defined]
    assert a.write(seq, 0, 9, 1) is None  # held locally already: nothing to store again
    dst_ids = [11, 10, 7, 0, 1, 2, 3, 4]
    read = await b.read(sequence(list(range(37)), dst_ids), 9)
    assert read is not None and read.num_blocks == 8  # rounds down to whole super blocks
    import_all(b, read, dst_ids)
    assert np.array_equal(kv_b.blocks[dst_ids], kv_a.blocks[src_ids[:8]])
    await asyncio.sleep(0)
    assert b.announced.stored == seq.block_hashes[:8]  # type: ignore[attr-defined]
    b.release(read.lease_id)
    store.down = ServiceUnavailableError("gone")
    again = await b.read(sequence(list(range(37)), dst_ids), 9)  # now a local hit: the store is not asked
    assert again is not None and again.num_blocks == 8
    assert await b.read(sequence(list(range(37)), dst_ids), 7) is not None  # 7 blocks: one super block
    assert await b.read(sequence(list(range(37)), dst_ids), 3) is None


async def test_a_super_block_corrupt_in_the_store_is_a_miss_from_there() -> None:
    store = FakeStore()
    kv_a = FakeKv(12, seed=1)
    a = tier(store, kv_a, "engine-a")
    seq = sequence(list(range(37)), [3, 1, 4, 0, 5, 9, 2, 6, 8])
    done = a.write(seq, 0, 9, 1)
    assert done is not None
    await done  # committed with the checksums of the bytes it uploaded
    key = seq.block_hashes[2 * CB - 1]
    second = store.table.pin_prefix([key])[0]
    store.table.unpin([key])
    store.region[second + 17] ^= 0xFF  # the store's copy of super block 2 changes after its commit
    b = tier(store, FakeKv(12, seed=2), "engine-b")
    read = await b.read(sequence(list(range(37)), list(range(8))), 9)
    assert read is not None and read.num_blocks == CB  # super block 1 only: the corrupt one is a miss
    assert len(b.cache) == 1  # its slot went back
    unchecked = tier(store, FakeKv(12, seed=3), "engine-c", verify=False)  # the check is what catches it
    loaded = await unchecked.read(sequence(list(range(37)), list(range(8))), 9)
    assert loaded is not None and loaded.num_blocks == 2 * CB


async def test_a_store_that_is_down_is_a_miss_and_the_local_cache_still_fills() -> None:
    store = FakeStore()
    store.down = ServiceUnavailableError("no responders")
    t = tier(store, FakeKv(12), "engine-a")
    seq = sequence(list(range(40)), list(range(10)))
    assert await t.read(seq, 9) is None
    assert len(t.cache) == 0  # the GET never reached a store: its slots are free again
    done = t.write(seq, 0, 10, 1)
    assert done is not None
    await done  # never raises
    assert store.failures == ["service_unavailable", "service_unavailable"] and store.table.num_committed == 0
    read = await t.read(seq, 9)
    assert read is not None and read.num_blocks == 8


async def test_a_get_past_its_deadline_keeps_its_slots_until_a_late_write_cannot_land() -> None:
    store = FakeStore()
    writer = tier(store, FakeKv(12), "engine-w")
    seq = sequence(list(range(40)), list(range(10)))
    done = writer.write(seq, 0, 10, 1)
    assert done is not None
    await done
    store.hangs = True
    t = tier(store, FakeKv(12), "engine-a")
    assert await t.read(seq, 9) is None and store.failures == ["deadline_exceeded"]
    assert len(t.cache) == 2  # quarantined: the store may still be writing into them
    assert await t.read(seq, 9) is None  # and they are no hit
    await asyncio.sleep(3 * store.timeout_s)
    assert len(t.cache) == 0
    store.hangs = False
    read = await t.read(seq, 9)
    assert read is not None and read.num_blocks == 8


async def test_pinned_reads_are_never_evicted_and_release_takes_the_lease_id() -> None:
    store = FakeStore()
    t = tier(store, FakeKv(20), "engine-a", cache_chunks=2)
    first = sequence(list(range(33)), list(range(8)))
    done = t.write(first, 0, 8, 1)
    assert done is not None
    await done
    read = await t.read(first, 8)
    assert read is not None
    other = sequence(list(range(100, 133)), list(range(8, 16)))
    assert t.write(other, 0, 8, 1) is None  # both slots pinned by the read: nothing reserved
    t.release(read.lease_id)
    t.release(read)  # idempotent
    done = t.write(other, 0, 8, 1)
    assert done is not None
    await done
    await asyncio.sleep(0)
    assert t.announced.removed == first.block_hashes[:8]  # type: ignore[attr-defined]
    await t.close()


def test_a_cache_smaller_than_a_super_block_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        RemoteTier(
            FakeStore(),  # type: ignore[arg-type]
            FakeReceiver(),  # type: ignore[arg-type]
            FakeAnnouncer(),  # type: ignore[arg-type]
            LAYOUT,
            FakeKv(1),
            engine_id="e",
            seed=1,
            chunk_blocks=CB,
            cache_bytes=CHUNK_BYTES - 1,
        )


async def test_a_read_of_super_blocks_another_request_is_fetching_waits_for_that_get() -> None:
    """Two requests for the same document on one engine: the second waits for the first's GET and pins what
    it brought, instead of counting those super blocks as misses (and recomputing them)."""
    store = FakeStore()
    kv_a, kv_b = FakeKv(12, seed=1), FakeKv(12, seed=2)
    a, b = tier(store, kv_a, "engine-a"), tier(store, kv_b, "engine-b")
    src_ids = [3, 1, 4, 0, 5, 9, 2, 6, 8]
    done = a.write(sequence(list(range(37)), src_ids), 0, 9, 1)
    assert done is not None
    await done
    store.delay_s = 0.05
    first, second = await asyncio.gather(
        b.read(sequence(list(range(37)), [11, 10, 7, 0, 1, 2, 3, 4]), 9),
        b.read(sequence(list(range(37)), [0, 1, 2, 3, 4, 5, 6, 7]), 9),
    )
    assert first is not None and second is not None
    assert (first.num_blocks, second.num_blocks, store.num_gets) == (8, 8, 1)
    import_all(b, second, [0, 1, 2, 3, 4, 5, 6, 7])
    assert np.array_equal(kv_b.blocks[:8], kv_a.blocks[src_ids[:8]])
    # a GET that never lands holds the other reader no longer than its own deadline: then it is a miss
    store.hangs = True
    c = tier(store, FakeKv(12), "engine-c")
    slow, waiting = await asyncio.gather(
        c.read(sequence(list(range(37)), list(range(8))), 9),
        c.read(sequence(list(range(37)), list(range(8))), 9),
    )
    assert slow is None and waiting is None

"""The engine's pool tier checks each block's checksum once per commit: its writer hashed it to commit it,
another engine hashes it on its first load, a re-load of a block it verified is not hashed again, a slot
freed and committed again is verified again, and a corrupt block is a miss on every load. A real block
table and codec behind a synchronous stand-in of the client (`_Client`: every call goes through
`PoolCore.handle`, as the CXL-RPC server's thread would run it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from gpu.kv_cache import PagedKVCache
from services.cxlpool.block_table import BlockTable
from services.cxlpool.core import PoolCore
from services.engine import pool_tier
from services.engine.pool_tier import PoolTier
from services.engine.sequence import Sequence
from shared.blocks import BlockLayout
from shared.cxl import pool_ops as ops
from shared.cxl.pool_memory import PoolGeometry, PoolMemory
from shared.cxl.pool_ops import Op, PoolStatus
from shared.protocol.kv import PoolInfo
from shared.protocol.messages import SamplingParams
from shared.protocol.tasks import RequestPlan

LAYOUT = BlockLayout(num_layers=3, block_size=4, bytes_per_token_layer=16)  # 192-byte slots
NUM_SLOTS = 6


class _Client:
    """The parts of `PoolClient` the tier calls, answered by a real `PoolCore`."""

    is_local = True

    def __init__(self, memory: PoolMemory, core: PoolCore) -> None:
        self.memory, self.core = memory, core

    def _call(self, op: Op, payload: bytes) -> bytes:
        status, reply = self.core.handle("engine", op, payload)
        assert status == PoolStatus.OK, reply
        return reply

    def lookup_now(self, hashes: list[int], *, pin: bool, lease_ms: int, timeout_s: float) -> ops.LookupReply:
        return ops.decode_lookup_reply(
            self._call(Op.LOOKUP, ops.encode_lookup(hashes, pin=pin, lease_ms=lease_ms))
        )

    def alloc_now(
        self, hashes: list[int], parents: list[int], *, lease_ms: int, timeout_s: float
    ) -> list[int]:
        return ops.decode_slots(self._call(Op.ALLOC, ops.encode_alloc(hashes, parents, lease_ms=lease_ms)))

    async def commit(self, hashes: list[int], checksums: list[int], *, timeout_s: float) -> list[int]:
        return ops.decode_generations(self._call(Op.COMMIT, ops.encode_commit(hashes, checksums)))

    async def unpin(self, lease_id: int, *, timeout_s: float) -> bool:
        return self._call(Op.UNPIN, ops.encode_lease(lease_id)) == b"\x01"

    def close(self) -> None:
        pass


@pytest.fixture
def memory() -> Iterator[PoolMemory]:
    geometry = PoolGeometry(LAYOUT.full_block_bytes, NUM_SLOTS, num_devices=2, interleave_bytes=2 * 192)
    mem = PoolMemory.create(geometry, f"kvpath-test-{uuid.uuid4().hex[:8]}")
    yield mem
    mem.close()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every slot the tier hashes, in order."""
    calls: list[int] = []
    real = pool_tier.block_checksum

    def counting(block: np.ndarray) -> int:
        calls.append(block.ctypes.data)
        return real(block)

    monkeypatch.setattr(pool_tier, "block_checksum", counting)
    return calls


def _tier(memory: PoolMemory, core: PoolCore | None = None) -> tuple[PoolTier, PagedKVCache, BlockTable]:
    """An engine's pool tier (its own cache); `core`: the pool another engine's tier uses (else a new one)."""
    if core is None:
        info = PoolInfo(
            pool_id="p", epoch=1000, fingerprint="fp", block_size=4, slot_bytes=LAYOUT.full_block_bytes,
            num_slots=NUM_SLOTS, num_devices=2, interleave_bytes=2 * 192, device_paths=memory.paths,
        )  # fmt: skip
        core = PoolCore(BlockTable(NUM_SLOTS, first_generation=1000), info, default_lease_ms=1000)
    kv = PagedKVCache(num_blocks=16, num_layers=3, block_size=4, kv_dim=4, dtype="float32", device="cpu")
    client = _Client(memory, core)
    return PoolTier(client, LAYOUT, kv, verify_checksums=True, lease_ms=1000), kv, core.table  # type: ignore[arg-type]


def _reader(memory: PoolMemory, writer: PoolTier) -> tuple[PoolTier, PagedKVCache]:
    """Another engine's tier on the writer's pool."""
    tier, kv, _ = _tier(memory, writer.client.core)  # type: ignore[attr-defined]
    return tier, kv


def _sequence(name: str, block_ids: list[int]) -> Sequence:
    plan = RequestPlan(
        request_id=name, router_id="t", prompt_token_ids=[0], sampling=SamplingParams(max_tokens=1),
        deadline_unix_s=time.time() + 60,
    )  # fmt: skip
    hashes = [hash((name, i)) & (2**63 - 1) for i in range(len(block_ids))]
    return Sequence(plan=plan, arrived_at=0.0, block_ids=block_ids, block_hashes=hashes)


async def _write(tier: PoolTier, kv: PagedKVCache, seq: Sequence, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (len(seq.block_ids), *LAYOUT.shape), dtype=np.uint8)
    kv.import_blocks(seq.block_ids, data)
    wait = tier.write(seq, 0, len(seq.block_ids), parent=1)
    assert wait is not None
    await wait
    return data


async def _load(tier: PoolTier, kv: PagedKVCache, seq: Sequence) -> np.ndarray | None:
    read = await tier.read(seq, len(seq.block_ids))
    if read is None:
        return None
    dest = list(range(10, 10 + read.num_blocks))
    tier.import_blocks(dest, read)
    tier.release(read)
    assert await tier._background.settled(5.0)  # the unpin (in the background)
    out = np.empty((read.num_blocks, *LAYOUT.shape), dtype=np.uint8)
    kv.export_blocks(dest, out)
    return out


async def test_the_writer_counts_its_own_commit_verified(memory: PoolMemory, hashed: list[int]) -> None:
    writer, kv, _ = _tier(memory)
    seq = _sequence("a", [0, 1, 2])
    data = await _write(writer, kv, seq, seed=1)
    assert len(hashed) == 3  # to commit them, from the slots' bytes
    del hashed[:]
    loaded = await _load(writer, kv, seq)
    assert loaded is not None and loaded.tobytes() == data.tobytes() and not hashed
    reader, reader_kv = _reader(memory, writer)  # another engine has not verified them yet
    loaded = await _load(reader, reader_kv, seq)
    assert loaded is not None and loaded.tobytes() == data.tobytes() and len(hashed) == 3


async def test_a_verified_block_is_not_hashed_again_while_its_commit_stands(
    memory: PoolMemory, hashed: list[int]
) -> None:
    writer, kv, _ = _tier(memory)
    tier, reader_kv = _reader(memory, writer)
    seq = _sequence("a", [0, 1, 2])
    data = await _write(writer, kv, seq, seed=1)
    del hashed[:]
    first = await _load(tier, reader_kv, seq)
    assert first is not None and first.tobytes() == data.tobytes() and len(hashed) == 3
    for _ in range(3):
        again = await _load(tier, reader_kv, seq)
        assert again is not None and again.tobytes() == data.tobytes()
    assert len(hashed) == 3 and tier.verified.num_skipped == 9
    longer = _sequence("a", [0, 1, 2, 3])  # the same prefix and one more block: only that one is new
    await _write(writer, kv, longer, seed=1)
    del hashed[:]
    loaded = await _load(tier, reader_kv, longer)
    assert loaded is not None and len(loaded) == 4 and len(hashed) == 1


async def test_a_slot_freed_and_committed_again_is_verified_again(
    memory: PoolMemory, hashed: list[int]
) -> None:
    writer, kv, table = _tier(memory)
    tier, reader_kv = _reader(memory, writer)
    seq = _sequence("a", [0, 1, 2])
    await _write(writer, kv, seq, seed=1)
    assert await _load(tier, reader_kv, seq) is not None
    slots = [table.entries[h].slot for h in seq.block_hashes]
    # the pool fills with another chain (6 slots): "a" is evicted, its slots hold new commits
    other = _sequence("b", [3, 4, 5, 6, 7, 8])
    data = await _write(writer, kv, other, seed=2)
    assert not set(seq.block_hashes) & set(table.entries) and set(slots) <= {
        table.entries[h].slot for h in other.block_hashes
    }
    del hashed[:]
    loaded = await _load(tier, reader_kv, other)
    assert loaded is not None and loaded.tobytes() == data.tobytes() and len(hashed) == 6
    # "a" written again, same bytes: some of its slots are ones it had before, under new generations
    await _write(writer, kv, seq, seed=1)
    del hashed[:]
    assert await _load(tier, reader_kv, seq) is not None and len(hashed) == 3


async def test_a_corrupt_block_is_a_miss_on_its_first_load_and_after(memory: PoolMemory) -> None:
    writer, kv, table = _tier(memory)
    tier, reader_kv = _reader(memory, writer)
    seq = _sequence("a", [0, 1, 2])
    data = await _write(writer, kv, seq, seed=1)
    memory.slot(table.entries[seq.block_hashes[1]].slot)[5] ^= 0xFF  # torn after its commit
    for _ in range(2):
        loaded = await _load(tier, reader_kv, seq)
        assert loaded is not None and len(loaded) == 1 and loaded.tobytes() == data[:1].tobytes()
    assert table.snapshot_stats().num_pinned == 0  # every lease ended


async def test_without_verification_nothing_is_hashed(memory: PoolMemory, hashed: list[int]) -> None:
    tier, kv, _ = _tier(memory)
    seq = _sequence("a", [0, 1])
    await _write(tier, kv, seq, seed=1)
    tier.verify_checksums = False
    del hashed[:]
    assert (loaded := await _load(tier, kv, seq)) is not None and len(loaded) == 2 and not hashed

"""The pool tier's copies outside a cluster: on the CPU, whole blocks and single layers go from interleaved
pool memory into the cache byte-exact (one copy per run of slots), and the device addresses a CUDA gather
would read are the slots' own addresses (the same arithmetic as the pool's striping). The client is a stand-in
(`_Client`) holding only the mapped memory: no RPC happens in these copies."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from gpu.kv_cache import PagedKVCache
from services.engine.pool_tier import PoolRead, PoolTier
from shared.blocks import BlockLayout
from shared.cxl.pool_memory import PoolGeometry, PoolMemory

LAYOUT = BlockLayout(num_layers=3, block_size=4, bytes_per_token_layer=16)  # 192-byte slots


@dataclass
class _Client:
    memory: PoolMemory


@pytest.fixture
def memory() -> Iterator[PoolMemory]:
    geometry = PoolGeometry(LAYOUT.full_block_bytes, 24, num_devices=3, interleave_bytes=2 * 192)
    mem = PoolMemory.create(geometry, f"kvpath-test-{uuid.uuid4().hex[:8]}")
    yield mem
    mem.close()


def _tier(memory: PoolMemory) -> tuple[PoolTier, PagedKVCache]:
    kv = PagedKVCache(num_blocks=16, num_layers=3, block_size=4, kv_dim=4, dtype="float32", device="cpu")
    return PoolTier(_Client(memory), LAYOUT, kv, verify_checksums=True, lease_ms=1000), kv  # type: ignore[arg-type]


def _fill(memory: PoolMemory, slots: list[int], seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (len(slots), *LAYOUT.shape), dtype=np.uint8)
    for i, slot in enumerate(slots):
        memory.slot(slot)[:] = data[i].reshape(-1)
    return data


def test_reads_across_interleaved_devices_land_byte_exact(memory: PoolMemory) -> None:
    tier, kv = _tier(memory)
    slots = [5, 6, 7, 0, 1, 13, 2]  # runs broken by the 2-slot stripes and by order
    data = _fill(memory, slots, seed=1)
    read = PoolRead(lease_id=0, slots=slots, runs=tier._runs(slots))
    assert len(read.runs) > 2
    targets = [9, 3, 4, 5, 11, 12, 0]
    tier.import_blocks(targets, read)
    out = np.empty_like(data)
    kv.export_blocks(targets, out)
    assert out.tobytes() == data.tobytes()
    kv.tensor.zero_()
    tier.import_layer(targets, read, 1)
    kv.export_blocks(targets, out)
    assert out[:, 1].tobytes() == data[:, 1].tobytes() and not out[:, 0].any() and not out[:, 2].any()


def test_device_addresses_are_the_slots_addresses(memory: PoolMemory) -> None:
    tier, _ = _tier(memory)
    tier._registered = _Registered([d.ctypes.data for d in memory.devices])  # identity mapping, as UVA gives
    slots = list(range(memory.geometry.num_slots))
    assert tier._device_ptrs(slots) == [memory.slot(s).ctypes.data for s in slots]


@dataclass
class _Registered:
    device_ptrs: list[int]

"""Pool memory: slots interleaved over devices, every slot on exactly one device, views shared by mappings."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from shared.blocks import BlockLayout
from shared.cxl.pool_memory import PoolGeometry, PoolMemory
from shared.errors import ConfigError


def test_interleaving_spreads_stripes_round_robin_and_covers_every_slot_once() -> None:
    g = PoolGeometry(slot_bytes=512 << 10, num_slots=37, num_devices=3, interleave_bytes=2 << 20)
    assert g.slots_per_stripe == 4
    assert [g.locate(s)[0] for s in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert g.locate(12) == (0, 4 * g.slot_bytes)  # the second row of device 0
    places = {g.locate(s) for s in range(g.num_slots)}
    assert len(places) == g.num_slots
    for d in range(3):
        on_device = [off for dev, off in places if dev == d]
        assert len(on_device) == g.device_slots(d)
        assert max(on_device) < g.device_slots(d) * g.slot_bytes
    assert sum(g.device_slots(d) for d in range(3)) == 37
    devices, rows = g.locate_many(np.arange(37))
    assert [(int(a), int(b) * g.slot_bytes) for a, b in zip(devices, rows, strict=True)] == [
        g.locate(s) for s in range(37)
    ]
    with pytest.raises(IndexError):
        g.locate(37)


def test_slots_bigger_than_the_interleave_alternate_devices() -> None:
    g = PoolGeometry(slot_bytes=3 << 20, num_slots=5, num_devices=2)
    assert g.slots_per_stripe == 1 and [g.locate(s)[0] for s in range(5)] == [0, 1, 0, 1, 0]


def test_two_mappings_see_the_same_bytes_and_runs_group_consecutive_slots() -> None:
    layout = BlockLayout(num_layers=2, block_size=4, bytes_per_token_layer=8)
    g = PoolGeometry(slot_bytes=layout.full_block_bytes, num_slots=20, num_devices=2, interleave_bytes=256)
    owner = PoolMemory.create(g, f"kvpath-test-{uuid.uuid4().hex[:8]}-pool")
    try:
        reader = PoolMemory.open(g, owner.paths)
        block = owner.block(5, layout)
        block[:] = np.arange(block.size, dtype=np.uint8).reshape(block.shape)
        assert np.array_equal(reader.block(5, layout), block)
        assert not np.shares_memory(reader.slot(4), reader.slot(5))
        # 4 slots per stripe: 0-3 on device 0, 4-7 on device 1, 8-11 on device 0 ...
        assert reader.runs([0, 1, 2, 3, 4, 5, 9]) == [(0, 4, 0, 0), (4, 2, 1, 0), (6, 1, 0, 5)]
        with pytest.raises(ConfigError):
            reader.block(0, BlockLayout(num_layers=1, block_size=4, bytes_per_token_layer=8))
        del block
        reader.close()
    finally:
        paths = list(owner.paths)
        owner.close()
    assert not any(os.path.exists(p) for p in paths)  # the creator unlinks its devices


def test_a_pool_smaller_than_a_stripe_per_device_leaves_devices_empty() -> None:
    g = PoolGeometry(slot_bytes=1024, num_slots=3, num_devices=4, interleave_bytes=2048)
    assert [g.device_slots(d) for d in range(4)] == [2, 1, 0, 0]
    memory = PoolMemory.create(g, f"kvpath-test-{uuid.uuid4().hex[:8]}-pool")
    try:
        memory.slot(2)[:] = 7
        assert [len(d) for d in memory.devices] == [2, 1, 0, 0]
    finally:
        memory.close()


def test_created_devices_are_allocated_up_front() -> None:
    g = PoolGeometry(slot_bytes=64 << 10, num_slots=48, num_devices=2)
    memory = PoolMemory.create(g, f"kvpath-test-{uuid.uuid4().hex[:8]}-pool")
    try:  # every byte of both devices is backed by tmpfs pages already, before anything is written
        assert [os.stat(p).st_blocks * 512 for p in memory.paths] == [g.device_bytes(0), g.device_bytes(1)]
    finally:
        memory.close()


def test_a_tmpfs_too_small_for_the_pool_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, size: int) -> None:  # fault injection: a full /dev/shm
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    prefix = f"kvpath-test-{uuid.uuid4().hex[:8]}-pool"
    with pytest.raises(ConfigError, match=r"cannot allocate .*shm-size"):
        PoolMemory.create(PoolGeometry(slot_bytes=4096, num_slots=4), prefix)
    assert not any(p.name.startswith(prefix) for p in Path("/dev/shm").iterdir())  # nothing left behind

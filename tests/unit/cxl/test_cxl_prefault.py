"""Prefaulting the pool's mapping: after the thread ends, every page of every device is mapped in this
process (its resident set for those files is the whole pool, read from /proc/self/smaps), the bytes are
unchanged, and a stop ends the thread between chunks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.cxl.pool_memory import PoolGeometry, PoolMemory
from shared.cxl.prefault import Prefaulter

SLOT = 64 << 10


def _rss_bytes(paths: list[str]) -> int:
    """Bytes of `paths` mapped in this process's page tables (Rss of their mappings)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] in paths
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) << 10
    return total


@pytest.fixture
def pool() -> Iterator[PoolMemory]:
    geometry = PoolGeometry(SLOT, num_slots=96, num_devices=2, interleave_bytes=2 << 20)
    memory = PoolMemory.create(geometry, f"kvpath-test-{uuid.uuid4().hex[:8]}")
    yield memory
    memory.close()


def test_every_page_is_mapped_and_nothing_changes(pool: PoolMemory) -> None:
    pool.slot(3)[:] = 7  # a block written before (this process mapped its pages by writing them)
    before = _rss_bytes(pool.paths)
    assert before < 96 * SLOT // 4
    prefaulter = Prefaulter(pool.devices, chunk_bytes=1 << 20).start()
    assert prefaulter.wait(10.0) and not prefaulter.error
    assert prefaulter.populated_bytes == 96 * SLOT
    assert _rss_bytes(pool.paths) == 96 * SLOT
    assert (pool.slot(3) == 7).all() and not pool.slot(4).any()


def test_stop_ends_the_thread_between_chunks(pool: PoolMemory) -> None:
    prefaulter = Prefaulter(pool.devices, chunk_bytes=4096)
    prefaulter._stop.set()  # stopped before its first chunk
    prefaulter.start()
    assert prefaulter.wait(5.0) and prefaulter.populated_bytes == 0
    prefaulter.stop()  # after the end: a no-op

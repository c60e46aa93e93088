"""`TieredPrefix`, the pool-over-storage load and save the colocated, prefill and session connectors share:
the upper tier's longest prefix first, storage for the blocks after it, the copies in that order, the leases
ended once, and finished blocks written to the tier once each."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from services.engine.tiered_prefix import PrefixRead, TieredPrefix

BLOCK = 4


@dataclass
class FakeTierRead:
    num_blocks: int


@dataclass
class FakeTier:
    holds: int  # leading blocks the tier holds
    calls: list[tuple[Any, ...]] = field(default_factory=list)

    async def read(self, seq: Any, num_blocks: int) -> FakeTierRead | None:
        self.calls.append(("read", num_blocks))
        n = min(self.holds, num_blocks)
        return FakeTierRead(n) if n else None

    def import_layer(self, block_ids: list[int], read: Any, layer: int) -> None:
        self.calls.append(("import_layer", block_ids[: read.num_blocks], layer))

    def import_blocks(self, block_ids: list[int], read: Any) -> None:
        self.calls.append(("import_blocks", block_ids[: read.num_blocks]))

    def release(self, read: Any) -> None:
        self.calls.append(("release", read.num_blocks))

    def write(self, seq: Any, start: int, end: int, parent: int) -> None:
        self.calls.append(("write", start, end, parent))

    async def close(self) -> None:
        self.calls.append(("close",))


@dataclass
class FakeLease:
    num_blocks: int
    views: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.views = np.arange(self.num_blocks * 2).reshape(self.num_blocks, 2)

    def layer(self, layer: int) -> np.ndarray:
        return self.views[:, layer]


class FakeStorage:
    def __init__(self, holds: int) -> None:
        self.holds = holds
        self.reads: list[tuple[int, int]] = []
        self.released: list[FakeLease | None] = []
        self.persister = SimpleNamespace(seed=77)

    async def read_blocks(self, seq: Any, first: int, end: int) -> FakeLease | None:
        self.reads.append((first, end))
        n = min(self.holds, end) - first
        return FakeLease(n) if n > 0 else None

    def release(self, lease: FakeLease | None) -> None:
        self.released.append(lease)


class FakeKv:
    device = "cpu"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def import_blocks(self, block_ids: list[int], views: np.ndarray) -> None:
        self.calls.append(("import_blocks", block_ids, len(views)))

    def import_layer(self, block_ids: list[int], layer: int, views: np.ndarray) -> None:
        self.calls.append(("import_layer", block_ids, layer, len(views)))


def _seq(num_blocks: int = 8, computed: int = 0) -> Any:
    plan = SimpleNamespace(kv=SimpleNamespace(salt=0))
    hashes = [1000 + i for i in range(num_blocks)]
    return SimpleNamespace(request_id="r", block_hashes=hashes, num_computed_tokens=computed, plan=plan)


def _prefix(tier_holds: int | None, stored: int) -> tuple[TieredPrefix, FakeTier | None, FakeStorage, FakeKv]:
    tier = FakeTier(tier_holds) if tier_holds is not None else None
    storage, kv = FakeStorage(stored), FakeKv()
    return TieredPrefix(kv, tier, storage, BLOCK), tier, storage, kv  # type: ignore[arg-type]


async def test_the_tier_serves_its_longest_prefix_and_storage_the_blocks_after_it() -> None:
    prefix, tier, storage, kv = _prefix(tier_holds=3, stored=5)
    read = await prefix.read(_seq(), tier_blocks=6, stored_blocks=5)
    assert (read.num_tier_blocks, read.num_blocks) == (3, 5)
    assert tier is not None and tier.calls == [("read", 6)] and storage.reads == [(3, 5)]
    ids = [10, 11, 12, 13, 14]
    prefix.import_into(ids, read, None)  # the tier's blocks first, then storage's into the blocks after
    prefix.import_into(ids, read, 1)
    assert tier.calls[1:] == [("import_blocks", [10, 11, 12]), ("import_layer", [10, 11, 12], 1)]
    assert kv.calls == [("import_blocks", [13, 14], 2), ("import_layer", [13, 14], 1, 2)]
    lease = read.lease
    prefix.release(read)
    prefix.release(read)  # once: the leases are gone
    assert tier.calls[-1] == ("release", 3) and [x for x in storage.released if x is not None] == [lease]
    assert read.num_blocks == 0 and sum(c[0] == "release" for c in tier.calls) == 1


async def test_a_miss_in_the_tier_or_no_tier_reads_everything_from_storage() -> None:
    for tier_holds in (0, None):
        prefix, _, storage, _ = _prefix(tier_holds, stored=4)
        read = await prefix.read(_seq(), tier_blocks=6, stored_blocks=4)
        assert (read.num_tier_blocks, read.num_blocks, storage.reads) == (0, 4, [(0, 4)])
    prefix, tier, storage, _ = _prefix(tier_holds=6, stored=4)
    skipped = await prefix.read(_seq(), tier_blocks=0, stored_blocks=4)  # not planned: storage only
    assert tier is not None and not tier.calls and skipped.num_blocks == 4


async def test_the_tier_may_hold_more_than_storage() -> None:
    prefix, _, storage, _ = _prefix(tier_holds=6, stored=2)
    read = await prefix.read(_seq(), tier_blocks=6, stored_blocks=2)
    assert (read.num_tier_blocks, read.lease, storage.reads) == (6, None, [(6, 2)])


def test_save_writes_each_finished_block_to_the_tier_once() -> None:
    prefix, tier, _, _ = _prefix(tier_holds=0, stored=0)
    seq = _seq(computed=3 * BLOCK + 1)
    saved, _ = prefix.save(seq, 0)
    assert saved == 3
    again, _ = prefix.save(seq, saved)  # nothing new filled
    seq.num_computed_tokens = 5 * BLOCK
    more, _ = prefix.save(seq, again)
    assert tier is not None and (again, more) == (3, 5)
    writes = [c for c in tier.calls if c[0] == "write"]
    assert writes[1] == ("write", 3, 5, 1002)  # chained to the last block written
    assert writes[0][:3] == ("write", 0, 3)
    no_tier, _, _, _ = _prefix(None, stored=0)
    assert no_tier.save(_seq(computed=4 * BLOCK), 1) == (1, None)


def test_an_empty_read_is_empty() -> None:
    assert PrefixRead().num_blocks == 0

"""Named held chunks (the `kv_chunk` extension) in a holder's `HeldChunks`, over a real paged cache: a named
chunk is pinned (LRU eviction passes it by), a name moves to the chunk that takes it, a named pin supersedes
an idle unnamed chunk it overlaps, and unpinning frees a chunk left without names at once."""

from __future__ import annotations

import pytest

from gpu.kv_cache import PagedKVCache
from services.engine.holder import HeldChunk, HeldChunks
from shared.protocol.movequery import ChunkName


def cache() -> PagedKVCache:
    return PagedKVCache(num_blocks=32, num_layers=2, block_size=4, kv_dim=4, dtype="float32", device="cpu")


def pin(
    held: HeldChunks, kv: PagedKVCache, hashes: list[int], name: ChunkName | None = None
) -> HeldChunk | None:
    return held.pin(kv.allocate(len(hashes)), hashes, name)


def test_a_named_chunk_is_not_evicted_to_make_room_and_an_unnamed_one_is() -> None:
    kv = cache()
    held = HeldChunks(kv, block_size=4, budget_blocks=6, events=None)
    named = pin(held, kv, [1, 2, 3], ChunkName(name="repo", tenant="t"))
    old = pin(held, kv, [10, 11, 12])
    assert named is not None and old is not None and named.names == {"repo"}
    new = pin(held, kv, [20, 21, 22])  # the budget holds two: the unnamed one goes, though it is newer
    assert new is not None and held.chunks == [named, new]
    assert pin(held, kv, [30, 31, 32, 33]) is None  # only the unnamed one may go, and that is not enough:
    assert held.chunks == [named, new]  # nothing is evicted for a pin that fails
    assert kv.num_free_blocks == 32 - 3 - 3 - 4  # the refused pin's blocks are still the caller's


def test_a_name_moves_and_unpin_frees_a_chunk_left_without_names() -> None:
    kv = cache()
    held = HeldChunks(kv, block_size=4, budget_blocks=16, events=None)
    v1 = pin(held, kv, [1, 2], ChunkName(name="doc", tenant="a"))
    v2 = pin(held, kv, [5, 6, 7], ChunkName(name="doc", tenant="a"))
    other_tenant = pin(held, kv, [8, 9], ChunkName(name="doc", tenant="b"))
    assert v1 is not None and v2 is not None and other_tenant is not None
    assert v1.names == set() and v2.names == {"doc"} and other_tenant.names == {"doc"}  # v1 is evictable now
    held.name(v2, ChunkName(name="alias", tenant="a"))
    free = kv.num_free_blocks
    assert held.unpin(ChunkName(name="doc", tenant="a")) == [v2]
    assert v2 in held.chunks and kv.num_free_blocks == free  # still named "alias"
    held.acquire(v2)  # a route session reads it: unpinned, it stays until evicted
    assert held.unpin(ChunkName(name="alias", tenant="a")) == [v2] and v2 in held.chunks
    held.release(v2)
    assert held.unpin(ChunkName(name="doc", tenant="b")) == [other_tenant]
    assert other_tenant not in held.chunks and kv.num_free_blocks == free + 2  # freed at once
    assert held.unpin(ChunkName(name="nothing", tenant="a")) == []
    assert [i.names for i in held.infos()] == [[], []]


def test_a_named_pin_supersedes_an_idle_unnamed_chunk_it_overlaps_but_not_a_busy_or_named_one() -> None:
    kv = cache()
    held = HeldChunks(kv, block_size=4, budget_blocks=16, events=None)
    short = pin(held, kv, [1, 2])
    assert short is not None
    longer = pin(held, kv, [1, 2, 3, 4], ChunkName(name="doc"))
    assert longer is not None and held.chunks == [longer] and held.longest([1, 2, 3, 4, 5]) == (longer, 4)
    held.acquire(longer)
    held.unpin(ChunkName(name="doc"))
    assert pin(held, kv, [1, 2, 3, 4, 5], ChunkName(name="doc2")) is None  # busy: kept, the pin refused
    held.release(longer)
    held.name(longer, ChunkName(name="doc"))
    assert pin(held, kv, [1, 2, 3, 4, 5], ChunkName(name="doc2")) is None  # named by another: kept


@pytest.mark.parametrize("name", ["", "a b", "x" * 129, "ü", "a/b"])
def test_bad_chunk_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="chunk name"):
        ChunkName(name=name).check()


def test_one_tenants_named_chunks_stay_within_its_share_of_the_budget() -> None:
    kv = cache()
    held = HeldChunks(kv, block_size=4, budget_blocks=12, events=None, tenant_named_blocks=5)
    a = ChunkName(name="doc", tenant="a")
    first = pin(held, kv, [1, 2, 3], a)
    assert first is not None
    assert pin(held, kv, [5, 6, 7], ChunkName(name="other", tenant="a")) is None  # 6 > 5: refused
    assert pin(held, kv, [5, 6, 7], ChunkName(name="doc", tenant="b")) is not None  # another tenant's share
    second = pin(held, kv, [8, 9, 10, 11], a)  # the name moves off the first chunk: 4 <= 5
    assert second is not None and first.names == set() and second.names == {"doc"}
    unnamed = pin(held, kv, [20, 21])
    assert unnamed is not None and not held.name(unnamed, ChunkName(name="more", tenant="a"))  # 4 + 2 > 5
    assert unnamed.names == set() and second.names == {"doc"}  # a refused name changes nothing

"""The remote tier's super-block arithmetic and its engine-local LRU cache (pure bookkeeping)."""

from __future__ import annotations

import pytest

from services.engine.remote_cache import SuperBlockCache, chunk_keys, completed_chunks, whole_chunks
from shared.blocks import max_hit_blocks
from shared.hashing import block_hashes

BLOCK, CHUNK_TOKENS = 64, 256
CB = CHUNK_TOKENS // BLOCK  # 4 blocks a super block


def test_hits_round_down_to_whole_super_blocks() -> None:
    # 600 prompt tokens: 9 usable blocks (the last token's block is computed), 2 whole super blocks = 512
    usable = max_hit_blocks(600, BLOCK)
    assert usable == 9 and whole_chunks(usable, CB) * CHUNK_TOKENS == 512
    assert [whole_chunks(n, CB) for n in (0, 3, 4, 7, 8, 9)] == [0, 0, 1, 1, 2, 2]
    assert whole_chunks(-1, CB) == 0


def test_super_block_keys_are_last_block_hashes() -> None:
    hashes = block_hashes(list(range(3, 603)), BLOCK, "fp")
    assert len(hashes) == 9
    assert chunk_keys(hashes, 9, CB) == [hashes[3], hashes[7]]
    assert chunk_keys(hashes, 7, CB) == [hashes[3]]  # a partial super block has no key
    assert chunk_keys(hashes[:5], 100, CB) == [hashes[3]]  # never past the hashes there are
    # a key names the whole prefix: another prompt sharing the first 256 tokens shares the first key only
    other = block_hashes([*range(3, 259), *range(600, 900)], BLOCK, "fp")
    assert chunk_keys(other, 8, CB)[0] == hashes[3] and chunk_keys(other, 8, CB)[1] != hashes[7]


def test_completed_chunks_are_written_once_whatever_the_steps() -> None:
    steps = [(0, 1), (1, 3), (3, 4), (4, 9), (9, 12), (12, 13)]  # blocks that filled, step by step
    written = [c for start, end in steps for c in completed_chunks(start, end, CB)]
    assert written == [0, 1, 2]
    assert list(completed_chunks(8, 9, CB)) == []  # block 8 starts super block 2: not whole yet


def test_reserve_publish_hit_and_lru_eviction() -> None:
    cache = SuperBlockCache(2)
    a, evicted = cache.reserve(1, [10, 11])
    assert a is not None and not evicted and cache.ready_prefix([1]) == 0  # filling is not a hit
    cache.publish(a)
    cache.unpin([a])
    b, _ = cache.reserve(2, [20, 21])
    assert b is not None
    cache.publish(b)
    cache.unpin([b])
    assert cache.ready_prefix([1, 2, 3]) == 2
    cache.unpin(cache.pin([1]))  # 1 used: 2 is the LRU
    c, evicted = cache.reserve(3, [30, 31])
    assert c is not None and [e.key for e in evicted] == [2] and cache.ready_prefix([1, 3]) == 1
    assert cache.num_evicted == 1 and len(cache) == 2


def test_pinned_and_filling_entries_are_never_evicted() -> None:
    cache = SuperBlockCache(2)
    a, _ = cache.reserve(1, [10])
    b, _ = cache.reserve(2, [20])
    assert a is not None and b is not None
    cache.publish(a)  # ready but still pinned by its filler; b is filling
    assert cache.reserve(3, [30]) == (None, [])
    cache.unpin([a])
    c, evicted = cache.reserve(3, [30])
    assert c is not None and evicted == [a] and c.slot == a.slot


def test_a_failed_fill_gives_its_slot_back() -> None:
    cache = SuperBlockCache(1)
    a, _ = cache.reserve(1, [10])
    assert a is not None
    cache.drop(a)
    assert cache.get(1) is None and len(cache) == 0
    b, _ = cache.reserve(2, [20])
    assert b is not None and b.slot == a.slot
    cache.publish(b)
    cache.drop(b)  # a published entry is not dropped
    assert cache.get(2) is b
    with pytest.raises(ValueError):
        SuperBlockCache(0)

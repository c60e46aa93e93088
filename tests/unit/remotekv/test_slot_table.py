"""The remote KV store's pure core: slots, reservation -> commit publication, LRU eviction, accounting."""

from __future__ import annotations

import pytest

from services.remotekv.slot_table import SLOT_ALIGNMENT_BYTES, SlotTable
from shared.errors import InvalidRequestError

CHUNK = 3 * SLOT_ALIGNMENT_BYTES  # 3 pages a super block


def table(num_slots: int = 4) -> SlotTable:
    t = SlotTable(num_slots * CHUNK + 100)  # a tail too small for a slot is never used
    t.adopt("fp", CHUNK)
    return t


def test_geometry_and_offsets() -> None:
    t = table(4)
    assert (t.num_slots, t.chunk_bytes, t.slot_stride_bytes) == (4, CHUNK, CHUNK)
    assert t.region_bytes() == 4 * CHUNK <= t.capacity_bytes
    odd = SlotTable(10 * SLOT_ALIGNMENT_BYTES)
    odd.adopt("fp", SLOT_ALIGNMENT_BYTES + 1)  # slots are page aligned
    assert (odd.slot_stride_bytes, odd.num_slots) == (2 * SLOT_ALIGNMENT_BYTES, 5)
    result = odd.reserve([1, 2], now_s=0, ttl_s=1)
    assert [o % SLOT_ALIGNMENT_BYTES for o in result.offsets] == [0, 0]


def test_reserve_then_commit_publishes_and_accounts() -> None:
    t = table()
    r = t.reserve([10, 11], now_s=0, ttl_s=5)
    assert r.outcomes == ["ok", "ok"] and r.put_id > 0 and len(set(r.offsets)) == 2
    assert t.used_bytes == 2 * CHUNK and t.num_reservations == 1
    assert t.exists([10, 11]) == [False, False]  # reserved is not readable: no half-written super block
    assert t.pin_prefix([10, 11]) == []
    assert t.commit(r.put_id, [10, 11]) == (2, 0)
    assert t.exists([10, 11, 12]) == [True, True, False] and t.prefix_len([10, 11, 12]) == 2
    assert (t.num_committed, t.num_reservations) == (2, 0)
    assert t.commit(r.put_id, [10, 11]) == (0, 0)  # once


def test_partial_commit_releases_the_rest_and_unknown_puts_commit_nothing() -> None:
    t = table()
    r = t.reserve([1, 2, 3], now_s=0, ttl_s=5)
    assert t.commit(r.put_id, [2]) == (1, 2)  # 1 and 3 failed to write: given back
    assert t.exists([1, 2, 3]) == [False, True, False] and t.used_bytes == CHUNK
    assert t.commit(12345, [1]) == (0, 0)


def test_exists_and_duplicates_in_one_put() -> None:
    t = table()
    first = t.reserve([5], now_s=0, ttl_s=5)
    again = t.reserve([5, 6, 6], now_s=0, ttl_s=5)
    assert again.outcomes == ["exists", "ok", "exists"]  # being written by another PUT counts as held
    t.commit(first.put_id, [5])
    assert t.reserve([5], now_s=0, ttl_s=5).outcomes == ["exists"]


def test_expired_reservations_are_reaped_and_late_commits_ignored() -> None:
    t = table()
    r = t.reserve([1, 2], now_s=0, ttl_s=5)
    assert t.reap(4.9) == 0
    assert t.reap(5.0) == 1
    assert t.used_bytes == 0 and t.commit(r.put_id, [1, 2]) == (0, 0)
    assert t.reserve([1, 2], now_s=6, ttl_s=5).outcomes == ["ok", "ok"]


def test_lru_eviction_when_full_skips_pinned_and_reserved() -> None:
    t = table(3)
    for key in (1, 2, 3):
        t.commit(t.reserve([key], now_s=0, ttl_s=5).put_id, [key])
    assert t.pin_prefix([1]) == [t.offset(0)]  # 1 is read now (and most recently used)
    r = t.reserve([4], now_s=0, ttl_s=5)
    assert r.outcomes == ["ok"] and r.evicted_keys == [2]  # 1 pinned, 2 the LRU
    t.unpin([1])
    t.pin_prefix([3])  # 3 is read now: 1 is the LRU, 4 is only reserved
    r2 = t.reserve([5, 6], now_s=0, ttl_s=5)
    assert r2.evicted_keys == [1] and r2.outcomes == ["ok", "full"]  # then only pinned or reserved left
    assert t.num_evicted == 2 and t.exists([1, 2, 3]) == [False, False, True]
    assert t.used_bytes == t.num_slots * CHUNK


def test_full_when_everything_is_pinned_or_reserved() -> None:
    t = table(2)
    a = t.reserve([1], now_s=0, ttl_s=5)
    t.commit(a.put_id, [1])
    t.pin_prefix([1])
    t.reserve([2], now_s=0, ttl_s=5)  # reserved, not evictable
    r = t.reserve([3], now_s=0, ttl_s=5)
    assert r.outcomes == ["full"] and r.put_id == 0 and r.offsets == [-1]


def test_a_put_never_evicts_what_it_asks_about() -> None:
    t = table(2)
    for key in (1, 2):
        t.commit(t.reserve([key], now_s=0, ttl_s=5).put_id, [key])
    r = t.reserve([1, 3], now_s=0, ttl_s=5)  # 1 is held: touched, so 2 goes
    assert r.outcomes == ["exists", "ok"] and r.evicted_keys == [2]


def test_format_is_adopted_once_and_readopted_when_empty() -> None:
    t = table(2)
    r = t.reserve([1], now_s=0, ttl_s=5)
    with pytest.raises(InvalidRequestError):
        t.adopt("other-fp", CHUNK)
    with pytest.raises(InvalidRequestError):
        t.adopt("fp", 2 * CHUNK)
    assert t.holds_format("fp", CHUNK) and not t.holds_format("fp", CHUNK + 1)
    t.commit(r.put_id, [])  # empty again
    t.adopt("other-fp", 2 * CHUNK)
    assert (t.num_slots, t.fingerprint) == (1, "other-fp")
    with pytest.raises(InvalidRequestError):
        SlotTable(CHUNK).adopt("fp", CHUNK + 1)  # larger than the whole store

"""Pure cores of the storage service: LRU catalog, token bucket, lease table."""

from __future__ import annotations

import pytest

from services.storage.disk_room import RESERVE_MAX_BYTES, reserve_bytes
from services.storage.leases import Lease, LeaseTable
from services.storage.lru import LruCatalog
from services.storage.token_bucket import TokenBucket


def test_lru_order_capacity_and_accounting() -> None:
    lru = LruCatalog(capacity_bytes=300)
    for i in range(3):
        lru.add((1, i), 100, now_s=i)
    assert lru.used_bytes == 300 and not lru.fits(1) and lru.can_ever_fit(300) and not lru.can_ever_fit(301)
    assert lru.touch((1, 0), now_s=10)  # 0 becomes most recent
    assert not lru.touch((1, 99), now_s=10)
    victim = lru.pop_lru()
    assert victim is not None and victim[0] == (1, 1) and lru.used_bytes == 200
    lru.add((1, 2), 150, now_s=11)  # re-adding replaces the old size
    assert lru.used_bytes == 250 and len(lru) == 2
    assert lru.remove((1, 2)) and not lru.remove((1, 2)) and lru.used_bytes == 100
    assert LruCatalog(0).fits(10**15)  # 0 = unlimited


def test_eviction_takes_chain_tails_first_and_never_a_pinned_block() -> None:
    """A block goes only when no block after it in its chain is kept (vLLM's rule), whatever the recency;
    a block being written is never a candidate; children may arrive before their parent."""
    lru = LruCatalog(capacity_bytes=0)
    head, mid, tail, other = (1, 10), (1, 11), (1, 12), (1, 20)
    lru.add(tail, 100, now_s=0, parent=mid)  # written out of order: the tail first
    lru.add(head, 100, now_s=1, parent=(1, 0))
    lru.add(mid, 100, now_s=2, parent=head)
    lru.add(other, 100, now_s=3, parent=(1, 0))
    lru.touch(tail, now_s=9)  # the tail is the most recent, the head the least: still the tail goes first
    lru.pin(other)
    order = []
    while (victim := lru.pop_lru()) is not None:
        order.append(victim[0])
    assert order == [tail, mid, head] and len(lru) == 1 and lru.used_bytes == 100  # `other`: pinned
    lru.unpin(other)
    victim = lru.pop_lru()
    assert victim is not None and victim[0] == other
    assert lru.used_bytes == 0 and not lru._orphans  # nothing left behind in the bookkeeping


def test_token_bucket_paces_bytes() -> None:
    bucket = TokenBucket(rate_bytes_per_s=1000.0)
    done = [bucket.reserve(100, now_s=0.0) for _ in range(10)]
    assert done == pytest.approx([0.1 * (i + 1) for i in range(10)])
    assert bucket.backlog_s(0.5) == pytest.approx(0.5)
    # after an idle period the clock restarts at now (no credit without burst)
    assert bucket.reserve(100, now_s=5.0) == pytest.approx(5.1)
    burst = TokenBucket(rate_bytes_per_s=1000.0, burst_bytes=200)
    assert burst.reserve(100, now_s=10.0) == pytest.approx(9.9)  # covered by burst credit
    assert burst.reserve(100, now_s=10.0) == pytest.approx(10.0)
    assert burst.reserve(100, now_s=10.0) == pytest.approx(10.1)
    unlimited = TokenBucket(0)
    assert unlimited.is_unlimited and unlimited.reserve(10**12, now_s=3.0) == 3.0


def test_token_bucket_rate_over_a_window() -> None:
    bucket = TokenBucket(rate_bytes_per_s=50e6)
    t, sent = 0.0, 0
    while t < 2.0:  # a reader that issues the next block as soon as the previous one completed
        t = bucket.reserve(1_000_000, now_s=t)
        sent += 1_000_000
    assert sent / t == pytest.approx(50e6, rel=0.01)


def test_lease_table_release_expiry_and_per_request() -> None:
    table = LeaseTable()
    table.add(Lease("a", "r1", 0, 2, 100, deadline_s=5.0))
    table.add(Lease("b", "r1", 4096, 1, 100, deadline_s=1.0))
    table.add(Lease("c", "r2", 8192, 1, 100, deadline_s=3.0))
    with pytest.raises(KeyError):
        table.add(Lease("a", "r9", 0, 1, 1, deadline_s=9.0))
    assert table.leased_bytes == 400 and table.next_deadline_s() == 1.0
    lease = table.pop("b")
    assert lease is not None and lease.offset == 4096 and table.pop("b") is None
    assert table.next_deadline_s() == 3.0  # the released lease no longer counts
    assert [x.lease_id for x in table.pop_expired(4.0)] == ["c"]
    assert [x.lease_id for x in table.pop_request("r1")] == ["a"]
    assert len(table) == 0 and table.pop_expired(100.0) == [] and table.next_deadline_s() is None


def test_the_free_space_a_store_without_capacity_keeps() -> None:
    """`disk_room.reserve_bytes`: `min_free_bytes` as given; by default 5% of the disk, at most 1 GiB."""
    assert reserve_bytes(100 << 20, -1) == 5 << 20
    assert reserve_bytes(1 << 40, -1) == RESERVE_MAX_BYTES
    assert reserve_bytes(1 << 40, 0) == 0 and reserve_bytes(1 << 20, 4096) == 4096

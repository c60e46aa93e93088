"""The pool's block table: publish-then-read, pins and leases, chain-tail LRU eviction, dead clients."""

from __future__ import annotations

import random

from services.cxlpool.block_table import NO_ROOM, NO_SLOT, BlockTable

SEC = 1_000_000_000
SEED = 7  # the parent of a chain's first block


def chain(name: int, n: int) -> tuple[list[int], list[int]]:
    """Hashes of an n-block chain and their parents."""
    hashes = [name * 1000 + i for i in range(n)]
    return hashes, [SEED, *hashes[:-1]]


def write(
    table: BlockTable, hashes: list[int], parents: list[int], owner: str = "w", now: int = 0
) -> list[int]:
    slots, _ = table.alloc(hashes, parents, owner, lease_ns=10 * SEC, now_ns=now)
    table.commit(hashes, [h * 3 for h in hashes], owner)
    return slots


def test_readers_see_only_committed_blocks_and_the_longest_prefix() -> None:
    table = BlockTable(8)
    hashes, parents = chain(1, 3)
    slots, evicted = table.alloc(hashes, parents, "w", lease_ns=SEC, now_ns=0)
    assert sorted(slots) == [0, 1, 2] and not evicted
    assert table.lookup(hashes, "r", pin=False, lease_ns=SEC, now_ns=0).slots == []  # not published
    assert table.commit(hashes[:2], [11, 22], "other") == []  # not the writer
    assert table.commit(hashes[:2], [11, 22], "w") == hashes[:2]
    hit = table.lookup(hashes, "r", pin=False, lease_ns=SEC, now_ns=0)
    assert (hit.slots, hit.checksums, hit.lease_id) == (slots[:2], [11, 22], 0)
    assert table.lookup([hashes[1]], "r", pin=False, lease_ns=SEC, now_ns=0).slots == [slots[1]]
    # a second writer of the same blocks is told to skip them
    again, _ = table.alloc(hashes, parents, "w2", lease_ns=SEC, now_ns=0)
    assert again == [NO_SLOT, NO_SLOT, NO_SLOT]


def test_eviction_takes_chain_tails_first_and_never_pinned_blocks() -> None:
    table = BlockTable(4)
    old, old_parents = chain(1, 3)
    write(table, old, old_parents)
    lease = table.lookup(old[:1], "r", pin=True, lease_ns=SEC, now_ns=0).lease_id
    new, new_parents = chain(2, 3)  # needs 3 slots; 1 is free
    slots, evicted = table.alloc(new, new_parents, "w", lease_ns=SEC, now_ns=0)
    # the tail 1002 goes, then 1001 (a tail once 1002 is gone); 1000 is pinned
    assert evicted == [old[2], old[1]] and NO_ROOM not in slots[:3]
    assert table.lookup(old, "r", pin=False, lease_ns=SEC, now_ns=0).slots == [table.entries[old[0]].slot]
    table.commit(new, [1, 2, 3], "w")
    # full: the only evictable block is the new chain's tail; the pinned old head stays
    slots, evicted = table.alloc(chain(3, 1)[0], [SEED], "w", lease_ns=SEC, now_ns=0)
    assert evicted == [new[2]] and slots[0] >= 0 and old[0] in table.entries
    # pin everything left: nothing can go
    table.lookup(new, "r", pin=True, lease_ns=SEC, now_ns=0)
    table.commit(chain(3, 1)[0], [9], "w")
    table.lookup(chain(3, 1)[0], "r", pin=True, lease_ns=SEC, now_ns=0)
    assert table.alloc(chain(4, 1)[0], [SEED], "w", lease_ns=SEC, now_ns=0) == ([NO_ROOM], [])
    assert table.unpin(lease, "r") and not table.unpin(lease, "r")
    slots, evicted = table.alloc(chain(4, 1)[0], [SEED], "w", lease_ns=SEC, now_ns=0)
    assert slots[0] >= 0 and evicted == [old[0]]  # unpinned: it can go now


def test_recently_read_chains_outlive_idle_ones() -> None:
    table = BlockTable(6)
    a, ap = chain(1, 2)
    b, bp = chain(2, 2)
    c, cp = chain(3, 2)
    for hashes, parents in ((a, ap), (b, bp), (c, cp)):
        write(table, hashes, parents)
    table.unpin(table.lookup(a, "r", pin=True, lease_ns=SEC, now_ns=0).lease_id, "r")  # a read last
    _, evicted = table.alloc(chain(4, 2)[0], chain(4, 2)[1], "w", lease_ns=SEC, now_ns=0)
    assert evicted == [b[1], b[0]]  # b was the least recently used; its tail went first


def test_leases_and_allocations_expire_and_dead_clients_are_released() -> None:
    table = BlockTable(4)
    hashes, parents = chain(1, 2)
    write(table, hashes, parents)
    table.lookup(hashes, "dead-reader", pin=True, lease_ns=SEC, now_ns=0)
    table.alloc(chain(2, 1)[0], [SEED], "dead-writer", lease_ns=5 * SEC, now_ns=0)
    assert table.snapshot_stats().num_pinned == 2 and table.snapshot_stats().num_allocated == 1
    table.expire(now_ns=2 * SEC)
    assert table.snapshot_stats().num_pinned == 0 and table.stats.expired_leases == 1
    table.expire(now_ns=6 * SEC)
    stats = table.snapshot_stats()  # the expired writer's slot is quarantined until it is known to be gone
    assert (stats.num_allocated, stats.num_free, stats.num_quarantined) == (0, 1, 1)
    table.release_owner("dead-writer")
    assert table.snapshot_stats().num_free == 2 and table.snapshot_stats().num_quarantined == 0
    table.lookup(hashes, "r2", pin=True, lease_ns=100 * SEC, now_ns=0)
    table.alloc(chain(3, 1)[0], [SEED], "r2", lease_ns=100 * SEC, now_ns=0)
    assert table.release_owner("r2") == (1, 1)
    assert table.snapshot_stats().num_pinned == 0 and table.snapshot_stats().num_free == 2


def test_every_commit_has_its_own_generation() -> None:
    table = BlockTable(2, first_generation=500)
    a, ap = chain(1, 2)
    write(table, a, ap)
    first = table.lookup(a, "r", pin=False, lease_ns=SEC, now_ns=0).generations
    assert first == [500, 501]
    b, bp = chain(2, 1)
    slots, evicted = table.alloc(b, bp, "w", lease_ns=SEC, now_ns=0)  # full: a's tail goes
    assert evicted == [a[1]] and slots == [table.entries[b[0]].slot]
    table.commit(b, [7], "w")
    again = table.lookup(b, "r", pin=False, lease_ns=SEC, now_ns=0)
    assert again.slots == [1] and again.generations == [502]  # the same slot, committed again: new number


def test_an_expired_writers_slot_is_not_reused_until_that_writer_stopped() -> None:
    table = BlockTable(2)
    h, parents = chain(1, 1)
    (slow_slot,), _ = table.alloc(h, parents, "slow", lease_ns=SEC, now_ns=0)
    table.expire(now_ns=2 * SEC)  # the slow writer may still be copying into slow_slot
    assert h[0] not in table.entries  # its block can be written again, elsewhere
    (other,), _ = table.alloc(h, parents, "fast", lease_ns=SEC, now_ns=2 * SEC)
    assert other != slow_slot
    table.commit(h, [9], "fast")
    table.lookup(h, "r", pin=True, lease_ns=10 * SEC, now_ns=2 * SEC)  # nothing evictable either
    assert table.alloc(chain(2, 1)[0], [SEED], "fast", lease_ns=SEC, now_ns=2 * SEC)[0] == [NO_ROOM]
    assert table.commit(h, [9], "slow") == []  # too late to publish, but it is done copying
    assert table.snapshot_stats().num_quarantined == 0
    slots, _ = table.alloc(chain(2, 1)[0], [SEED], "fast", lease_ns=SEC, now_ns=2 * SEC)
    assert slots == [slow_slot]
    other_table = BlockTable(1)  # a FREE tells the pool the same
    other_table.alloc(h, parents, "slow", lease_ns=SEC, now_ns=0)
    other_table.expire(now_ns=2 * SEC)
    assert other_table.snapshot_stats().num_quarantined == 1 and other_table.free(h, "slow") == 1
    assert other_table.snapshot_stats().num_free == 1


def test_a_random_workout_keeps_every_invariant() -> None:
    rng = random.Random(3)
    table = BlockTable(32)
    leases: list[tuple[int, str]] = []
    for step in range(3000):
        name, n = rng.randrange(40), rng.randrange(1, 6)
        hashes, parents = chain(name, n)
        owner = f"c{rng.randrange(4)}"
        action = rng.random()
        if action < 0.4:
            slots, _ = table.alloc(hashes, parents, owner, lease_ns=SEC, now_ns=step)
            mine = [h for h, s in zip(hashes, slots, strict=True) if s >= 0]
            if rng.random() < 0.8:
                table.commit(mine, [1] * len(mine), owner)
            else:
                table.free(mine, owner)
        elif action < 0.8:
            hit = table.lookup(hashes, owner, pin=rng.random() < 0.5, lease_ns=SEC, now_ns=step)
            if hit.lease_id:
                leases.append((hit.lease_id, owner))
        elif leases:
            table.unpin(*leases.pop(rng.randrange(len(leases))))
        _check(table)


def _check(table: BlockTable) -> None:
    slots = [e.slot for e in table.entries.values()]
    assert len(slots) == len(set(slots)), "two blocks share a slot"
    stats = table.snapshot_stats()
    assert len(slots) + stats.num_free + stats.num_quarantined == table.num_slots, "a slot leaked"
    for h, e in table.entries.items():
        children = sum(1 for c in table.entries.values() if c.parent == h and c.state == 2)
        assert e.state != 2 or e.num_children == children, "child count drifted"
        assert e.pins >= 0

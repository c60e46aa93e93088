"""The index core: numpy hash table, prefix match per tier/location, idempotent apply, snapshots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from services.index import snapshot
from services.index.hash_table import U64Table
from services.index.index import BlockIndex
from shared.protocol.kv import BlockRemoved, BlockStored, Cleared

_SEQ: dict[str, int] = {}


def _next(source: str) -> int:
    _SEQ[source] = _SEQ.get(source, 0) + 1
    return _SEQ[source]


def stored(hashes: list[int], location: str = "store", source: str = "s0", epoch: int = 1) -> BlockStored:
    return BlockStored(source=source, epoch=epoch, seq=_next(source), location=location, block_hashes=hashes)


def removed(hashes: list[int], location: str = "store", source: str = "s0") -> BlockRemoved:
    return BlockRemoved(source=source, epoch=1, seq=_next(source), location=location, block_hashes=hashes)


def _random_update(
    table: U64Table, ref: dict[int, int], keys: np.ndarray, rng: np.random.Generator, *, bits: int
) -> None:
    """Set (6 times in 10) or clear one random bit of `keys` in the table and in its dict twin."""
    bit = 1 << int(rng.integers(0, bits))
    if rng.random() < 0.6:
        table.or_values(keys, bit)
        for k in keys.tolist():
            ref[k] = ref.get(k, 0) | bit
    else:
        table.clear_bits(keys, bit)
        for k in keys.tolist():
            if ref.get(k, 0) & ~bit:
                ref[k] &= ~bit
            else:
                ref.pop(k, None)


def test_hash_table_matches_a_dict_under_random_operations() -> None:
    rng = np.random.default_rng(7)
    table, ref = U64Table(), {}
    universe = rng.integers(0, 2**64 - 1, size=5000, dtype=np.uint64, endpoint=True)
    universe[:3] = [0, 1, 2**64 - 1]  # no reserved keys
    for _ in range(200):
        _random_update(table, ref, rng.choice(universe, size=int(rng.integers(1, 300))), rng, bits=64)
    assert len(table) == len(ref)
    assert table.get(universe).tolist() == [ref.get(k, 0) for k in universe.tolist()]
    keys, values = table.items()
    assert dict(zip(keys.tolist(), values.tolist(), strict=True)) == ref
    assert table.num_live + table.num_tombstones <= table.capacity // 2


def test_hash_table_grows_and_reuses_tombstones() -> None:
    table = U64Table()
    keys = np.arange(1, 100_001, dtype=np.uint64)
    table.or_values(keys, 1)
    assert len(table) == 100_000 and table.capacity >= 200_000
    assert table.clear_bits(keys[:50_000], 1) == 50_000
    capacity = table.capacity
    table.or_values(keys[:50_000], 2)  # fills tombstones, no growth needed
    assert table.capacity == capacity and len(table) == 100_000
    assert table.get(keys[[0, 60_000]]).tolist() == [2, 1]
    assert table.clear_bits_everywhere(1) == 50_000 and len(table) == 50_000


def test_match_counts_leading_hits_per_tier_and_location() -> None:
    index = BlockIndex()
    index.apply(stored([10, 11, 12, 13]))
    index.apply(stored([10, 11], location="hbm:e1", source="e1"))
    index.apply(stored([10, 11, 12], location="hbm:e2", source="e2"))
    index.apply(stored([99], location="dram:0", source="d0"))
    out = index.match([10, 11, 12, 13, 14])
    assert out.num_hit_blocks == 4
    assert out.per_tier == {"store": 4, "hbm": 3}
    assert out.per_location == {"store": 4, "hbm:e1": 2, "hbm:e2": 3}
    # a hole ends the prefix even if later blocks are present
    index.apply(removed([11]))
    assert index.match([10, 11, 12, 13]).per_tier == {"store": 1, "hbm": 3}
    assert index.match([77, 10]).num_hit_blocks == 0 and index.match([]).num_hit_blocks == 0
    assert index.match(np.array([10], dtype=np.uint64)).per_location["hbm:e2"] == 1


def test_match_sees_masks_that_change_after_the_first_block() -> None:
    """`match` takes a shortcut when every block has the same mask; masks that differ later (a hole in
    one location, more holders further on) still give exact per-location prefixes."""
    chain = list(range(100, 140))
    index = BlockIndex()
    index.apply(stored(chain))
    index.apply(stored(chain[10:], location="dram:0", source="d0"))  # lacks the first block: no prefix
    assert index.match(chain).per_location == {"store": 40}
    index.apply(stored(chain[:20] + chain[21:], location="hbm:e1", source="e1"))  # a hole at block 20
    out = index.match(np.array(chain, dtype=np.uint64))
    assert out.num_hit_blocks == 40
    assert out.per_location == {"store": 40, "hbm:e1": 20}
    assert out.per_tier == {"store": 40, "hbm": 20}
    assert index.match(chain[:20]).per_location == {"store": 20, "hbm:e1": 20}


def test_duplicates_and_replays_are_ignored() -> None:
    index = BlockIndex()
    first = stored([1, 2, 3], source="dup")
    index.apply(first, stream_seq=1)
    rm = removed([2], source="dup")
    assert index.apply(rm, stream_seq=2)
    assert not index.apply(first, stream_seq=3)  # replayed: must not resurrect block 2
    assert not index.apply(rm, stream_seq=4)
    assert index.match([1, 2, 3]).num_hit_blocks == 1
    assert (index.num_events_applied, index.num_events_ignored, index.applied_stream_seq) == (2, 2, 4)
    # a restarted source (newer epoch) starts its seq again
    assert index.apply(BlockStored(source="dup", epoch=2, seq=1, location="store", block_hashes=[2]))
    assert index.match([1, 2, 3]).num_hit_blocks == 3
    assert not index.apply(BlockStored(source="dup", epoch=1, seq=99, location="store", block_hashes=[7]))


def test_cleared_drops_a_location_and_frees_its_bit() -> None:
    index = BlockIndex()
    index.apply(stored([1, 2], location="hbm:e1", source="e1"))
    index.apply(stored([1], location="store"))
    index.apply(Cleared(source="e1", epoch=1, seq=_next("e1"), locations=["hbm:e1", "hbm:unknown"]))
    assert index.match([1, 2]).per_location == {"store": 1}
    assert len(index) == 1 and index.live_locations() == ["store"]
    index.apply(stored([5], location="cxl:pool0", source="c"))
    assert index.locations[0] == "cxl:pool0"  # the freed bit is reused


def test_location_limit_is_logged_not_fatal() -> None:
    index = BlockIndex()
    for i in range(64):
        index.apply(stored([1000 + i], location=f"hbm:e{i}", source=f"e{i}"))
    assert index.apply(stored([5], location="hbm:one-too-many", source="x"))
    assert index.match([5]).num_hit_blocks == 0 and len(index) == 64


def test_snapshot_round_trip(tmp_path: Path) -> None:
    index = BlockIndex()
    rng = np.random.default_rng(3)
    hashes = rng.integers(0, 2**64 - 1, size=2000, dtype=np.uint64, endpoint=True).tolist()
    index.apply(stored(hashes, source="a"), stream_seq=5)
    index.apply(stored(hashes[:10], location="hbm:e1", source="e1"), stream_seq=6)
    path = tmp_path / snapshot.SNAPSHOT_NAME
    arrays, meta = index.snapshot()
    assert snapshot.save(path, arrays, meta) > 2000 * 16
    loaded = snapshot.load(path)
    assert loaded is not None
    again = BlockIndex.restore(*loaded)
    assert again.applied_stream_seq == 6 and again.sources == index.sources and len(again) == 2000
    assert again.match(hashes).per_location == {"store": 2000, "hbm:e1": 10}
    assert not again.apply(_replay_of_last(index, "a"))  # the restored source state still dedupes
    assert snapshot.load(tmp_path / "missing.npz") is None
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable"):
        snapshot.load(path)


def _replay_of_last(index: BlockIndex, source: str) -> BlockStored:
    """The last event applied for `source`, as a stream replay would deliver it again."""
    epoch, seq = index.sources[source]
    return BlockStored(source=source, epoch=epoch, seq=seq, location="store", block_hashes=[1])


def test_prefix_only_lookups_stop_after_the_first_absent_key() -> None:
    table = U64Table()
    table.or_values(np.array([1, 2, 4, 5], dtype=np.uint64), 1)
    keys = np.array([1, 2, 3, 4, 5], dtype=np.uint64)
    assert table.get(keys).tolist() == [1, 1, 0, 1, 1]
    full = table.get(keys, prefix_only=True).tolist()
    assert full[:3] == [1, 1, 0]  # what follows the first absent key does not matter to a prefix match
    index = BlockIndex()
    index.apply(stored([1, 2, 4, 5]))
    assert index.match([1, 2, 3, 4, 5]).num_hit_blocks == 2


def test_prefix_values_agree_with_find_over_full_buckets_tombstones_and_wraparound() -> None:
    rng = np.random.default_rng(11)
    table = U64Table(capacity=1024)
    keys = rng.integers(0, 2**64 - 1, size=500, dtype=np.uint64, endpoint=True)
    table.or_values(keys, 1)  # ~1/2 load: some buckets overflow into the next (and the last wraps)
    table.clear_bits(keys[::7], 1)  # tombstones inside buckets
    table.or_values(keys[::14], 2)  # some of them back, possibly in a later slot
    for start in range(0, 500, 50):
        chain = keys[start : start + 120]
        expected = table.get(chain)
        present = expected != 0
        end = int(present.size if present.all() else np.argmin(present))
        assert table.prefix_values(chain).tolist() == expected[:end].tolist()
    assert table.prefix_values(np.zeros(0, dtype=np.uint64)).size == 0
    assert table.prefix_values(np.array([0], dtype=np.uint64)).size == 0  # key 0 is an ordinary key


def _homed_in(table: U64Table, bucket: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` distinct random keys whose home bucket is `bucket`."""
    found: list[int] = []
    while len(found) < count:
        keys = rng.integers(1, 2**64 - 1, size=100_000, dtype=np.uint64, endpoint=True)
        found += keys[table._home_bucket(keys) == bucket].tolist()
    return np.array(found[:count], dtype=np.uint64)


def test_prefix_values_see_only_live_keys_in_a_bucket_of_tombstones_and_vacant_slots() -> None:
    """The one-compare fast path trusts "as many matches as keys": tombstones and vacant slots (keys 0 and
    1 among them) never match, a key stored again after its removal matches once, and a chain whose keys
    spill into the next bucket or are missing in the middle resolves like `get`."""
    rng = np.random.default_rng(5)
    table = U64Table(capacity=1024)
    zero_home = _homed_in(table, 0, 12, rng)  # bucket 0 overflows into bucket 1
    table.or_values(np.concatenate((np.array([0, 1], dtype=np.uint64), zero_home)), 1)
    table.clear_bits(np.array([0, 1], dtype=np.uint64), 1)  # tombstones at slots 0 and 1
    table.clear_bits(zero_home[3:6], 1)
    table.or_values(zero_home[4:5], 2)  # back in its bucket, in the first free slot
    others = rng.integers(2, 2**64 - 1, size=300, dtype=np.uint64, endpoint=True)
    table.or_values(others, 4)
    chains = [
        np.array([0], dtype=np.uint64),
        np.array([1, *zero_home[:3]], dtype=np.uint64),
        zero_home,
        np.concatenate((zero_home[:3], zero_home[4:5], zero_home[6:], others)),
        np.concatenate((others[:100], zero_home[3:4], others[100:])),
        others,
    ]
    for chain in chains:
        expected = table.get(chain)
        present = expected != 0
        end = int(present.size if present.all() else np.argmin(present))
        assert table.prefix_values(chain).tolist() == expected[:end].tolist()
    fresh = U64Table(capacity=1024)  # bucket 0 vacant: key 0 must not match its 8 slots
    fresh.or_values(others[:10], 1)
    assert fresh.prefix_values(np.concatenate((np.zeros(1, dtype=np.uint64), others[10:17]))).size == 0
    index = BlockIndex()
    index.apply(stored(others.tolist()))
    index.apply(removed(others[200:201].tolist()))
    index.apply(stored(others[200:201].tolist()))
    assert index.match(others).num_hit_blocks == others.size
    index.apply(removed(others[100:101].tolist()))
    assert index.match(others).per_location == {"store": 100}


def test_keys_overflowing_far_and_around_the_end_are_found_in_the_stash_and_absent_keys_are_not() -> None:
    """50 keys homed in the last bucket fill it and spill over the wrap into buckets 0..5, further than
    the next bucket; removing some leaves tombstones in the run. Every lookup (`get`,
    `prefix_values`, a re-insert) agrees with a dict, and keys 0 and 1, which vacant slots hold past
    the home bucket, are not found there."""
    rng = np.random.default_rng(9)
    table = U64Table(capacity=1024)
    last = table.capacity // 8 - 1
    run = _homed_in(table, last, 50, rng)
    table.or_values(run, 1)
    assert len(table) == 50 and not (table.find(run) // 8 == last).all()  # some went past the end
    assert (table.find(run) // 8).tolist().count(5) > 0  # six buckets past the home: a second round
    table.clear_bits(run[::5], 1)  # tombstones inside the run
    ref = {int(k): (0 if i % 5 == 0 else 1) for i, k in enumerate(run)}
    assert table.get(run).tolist() == [ref[int(k)] for k in run]
    kept = run[[i for i in range(run.size) if i % 5]]
    assert table.prefix_values(kept).tolist() == [1] * kept.size
    assert table.prefix_values(run[1:]).tolist() == [1] * 4  # run[5] was removed: the prefix ends
    vacant = np.array([0, 1], dtype=np.uint64)  # bucket 0 is full of the run: key 0 is in neither
    assert table.get(vacant).tolist() == [0, 0] and table.prefix_values(vacant).size == 0
    table.or_values(np.concatenate((vacant, run[::5])), 2)  # back in, into tombstones or later
    assert table.get(np.concatenate((vacant, run[::5]))).tolist() == [2, 2] + [2] * 10
    assert table.prefix_values(np.concatenate((run, vacant))).size == 52


def _assert_stash_is_the_keys_outside_their_home_bucket(table: U64Table) -> None:
    slots = np.flatnonzero(table.states == 1)
    keys = table.keys[slots]
    outside = table._home_bucket(keys) != slots // 8
    assert table._stash == dict(zip(keys[outside].tolist(), slots[outside].tolist(), strict=True))


def test_lookups_agree_with_a_dict_on_long_overflow_runs_across_the_wrap() -> None:
    """Random stores, removals and prefix matches on keys crowded into a few home buckets (0, 1, 5 and the
    last two), so that overflow runs cross the table's end and reach several buckets on, mixed with
    absent keys and keys 0 and 1: `prefix_values` and `get` agree with a dict throughout, and the stash
    holds exactly the live keys outside their home buckets."""
    rng = np.random.default_rng(123)
    for _ in range(40):
        table, ref = U64Table(capacity=1024), {}
        last = table.capacity // 8 - 1
        crowded = np.concatenate([_homed_in(table, b, 80, rng) for b in (0, 1, 5, last - 1, last)])
        others = rng.integers(2, 2**64 - 1, size=200, dtype=np.uint64, endpoint=True)
        universe = np.concatenate((crowded, np.array([0, 1], dtype=np.uint64), others))
        for _ in range(30):
            _random_update(table, ref, rng.choice(universe, size=int(rng.integers(1, 60))), rng, bits=8)
            chain = rng.choice(universe, size=int(rng.integers(1, 120)))
            expected = [ref.get(k, 0) for k in chain.tolist()]
            end = expected.index(0) if 0 in expected else len(expected)
            assert table.prefix_values(chain).tolist() == expected[:end]
            assert table.get(chain).tolist() == expected
            stored = rng.permutation(np.array(sorted(ref), dtype=np.uint64))[:100]
            assert table.prefix_values(stored).tolist() == [ref[k] for k in stored.tolist()]
            _assert_stash_is_the_keys_outside_their_home_bucket(table)

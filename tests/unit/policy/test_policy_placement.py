"""Read side (brief 5.4) and the three policies end to end: dualpath, basic, dualpath-rr."""

from __future__ import annotations

import pytest

from services.policy.snapshot import (
    ClusterSnapshot,
    EngineSnapshot,
    PendingRequest,
    Placement,
    ReadSide,
    RoundRobinState,
)
from shared.errors import ConfigError, KvpathError
from tests.reference_placement import choose_read_side, place, place_basic, place_dualpath
from tests.unit.policy.snapshots import de, limits, node, pe, req, snap


def sides(placements: tuple[Placement, ...]) -> list[tuple[ReadSide | None, int | None]]:
    return [(p.read_side, p.read_node) for p in placements]


def one_pair(pe_q: int, de_q: int, *, pe_alive: bool = True, de_alive: bool = True) -> ClusterSnapshot:
    return snap(
        [pe("p", 0, 0), de("d", 1, 0)],
        [node(0, pe_q, is_alive=pe_alive), node(1, de_q, is_alive=de_alive)],
        [req("r1", 100, hit=90)],
    )


def test_read_side_is_the_shorter_queue_tie_goes_to_pe() -> None:
    alive = {0: True, 1: True}
    assert choose_read_side(0, 1, {0: 100, 1: 50}, alive) is ReadSide.DE
    assert choose_read_side(0, 1, {0: 50, 1: 100}, alive) is ReadSide.PE
    assert choose_read_side(0, 1, {0: 70, 1: 70}, alive) is ReadSide.PE


def test_dead_storage_is_never_the_read_side() -> None:
    assert choose_read_side(0, 1, {0: 0, 1: 999}, {0: False, 1: True}) is ReadSide.DE
    assert choose_read_side(0, 1, {0: 999, 1: 0}, {0: True, 1: False}) is ReadSide.PE
    assert choose_read_side(0, 1, {0: 0, 1: 0}, {0: False, 1: False}) is None


def test_dualpath_placement_reads_hits_on_the_shorter_side() -> None:
    (p,) = place_dualpath(one_pair(pe_q=100, de_q=50), limits(alpha=1000))
    assert p == Placement("r1", "p", "d", ReadSide.DE, 1, 90)


def test_no_live_storage_means_recompute() -> None:
    (p,) = place_dualpath(one_pair(0, 0, pe_alive=False, de_alive=False), limits())
    assert (p.read_side, p.read_node, p.read_tokens) == (None, None, 0)


def test_no_hit_means_no_read() -> None:
    s = snap([pe("p", 0, 0), de("d", 1, 0)], [node(0), node(1)], [req("r1", 100, hit=0)])
    (p,) = place_dualpath(s, limits())
    assert (p.read_side, p.read_tokens) == (None, 0)


def test_read_queue_grows_within_a_round() -> None:
    s = snap(
        [pe("p", 0, 0), de("d", 1, 0)],
        [node(0, 100), node(1, 40)],
        [req("r1", 100, hit=80), req("r2", 100, hit=80), req("r3", 100, hit=10)],
    )
    # r1 -> DE (40 < 100; DE queue 120); r2 -> PE (100 < 120; PE queue 180); r3 -> DE (120 < 180)
    assert sides(place_dualpath(s, limits(alpha=1000))) == [
        (ReadSide.DE, 1),
        (ReadSide.PE, 0),
        (ReadSide.DE, 1),
    ]


def test_round_stops_at_the_first_request_without_a_de() -> None:
    s = snap(
        [pe("p", 0, 0), de("d", 1, 0, free=150)],
        [node(0), node(1)],
        [req("r1", 10, hbm=100), req("r2", 10, hbm=100), req("r3", 10, hbm=10)],
    )
    assert [p.request_id for p in place_dualpath(s, limits())] == ["r1"]


def test_basic_always_reads_on_the_pe_node() -> None:
    s = snap(
        [pe("p", 0, 0), de("d", 1, 0)],
        [node(0, 10_000), node(1, 0)],
        [req("r1", 100, hit=90), req("r2", 100, hit=90)],
    )
    assert sides(place_basic(s, limits())) == [(ReadSide.PE, 0), (ReadSide.PE, 0)]
    (p,) = place_basic(one_pair(0, 0, pe_alive=False), limits())
    assert p.read_side is None  # Basic never uses the DE's SNIC: the request recomputes


def test_basic_picks_the_pe_by_tokens_alone() -> None:
    s = snap(
        [pe("short", 0, 80), pe("long", 1, 10), de("d", 2, 0)],
        [node(0, 0), node(1, 10_000), node(2, 0)],
        [req("r1", 5, hit=4)],
    )
    assert [p.pe_id for p in place_basic(s, limits(alpha=100))] == ["long"]
    assert [p.pe_id for p in place_dualpath(s, limits(alpha=100))] == ["short"]


def rr_cluster(queue: list[PendingRequest], extra: list[EngineSnapshot] | None = None) -> ClusterSnapshot:
    engines = [pe("pb", 0, 0), pe("pa", 0, 0), pe("pc", 1, 0), de("da", 2, 0), de("db", 3, 0)]
    return snap(engines + (extra or []), [node(0), node(1), node(2), node(3)], queue)


def test_round_robin_cycles_engines_and_alternates_sides() -> None:
    queue = [req(f"r{i}", 10, hit=5) for i in range(4)]
    result = place("dualpath-rr", rr_cluster(queue), limits())
    assert [(p.pe_id, p.de_id, p.read_side) for p in result.placements] == [
        ("pa", "da", ReadSide.PE),
        ("pb", "db", ReadSide.DE),
        ("pc", "da", ReadSide.PE),
        ("pa", "db", ReadSide.DE),
    ]
    assert result.rr_state == RoundRobinState(pe_cursor=1, de_cursor=0, next_side=ReadSide.PE)


def test_round_robin_state_carries_over_between_rounds() -> None:
    state = RoundRobinState(pe_cursor=2, de_cursor=1, next_side=ReadSide.DE)
    result = place("dualpath-rr", rr_cluster([req("r1", 10, hit=5), req("r2", 10)]), limits(), state)
    assert [(p.pe_id, p.de_id, p.read_side) for p in result.placements] == [
        ("pc", "db", ReadSide.DE),
        ("pa", "da", None),  # no hit: nothing to read, the side does not flip
    ]
    assert result.rr_state == RoundRobinState(pe_cursor=1, de_cursor=1, next_side=ReadSide.PE)


def test_round_robin_skips_full_engines_and_dead_storage() -> None:
    s = snap(
        [pe("pa", 0, 0), pe("pb", 0, 5000), de("da", 1, 0, free=5), de("db", 2, 0)],
        [node(0, is_alive=False), node(1), node(2)],
        [req("r1", 10, hit=5, hbm=20), req("r2", 10, hit=5, hbm=20)],
    )
    result = place("dualpath-rr", s, limits(beta=1000))
    # pb is over beta and da has no room; PE storage is dead, so the wanted PE side falls back to DE
    assert [(p.pe_id, p.de_id, p.read_side) for p in result.placements] == [
        ("pa", "db", ReadSide.DE),
        ("pa", "db", ReadSide.DE),
    ]


def test_place_dispatches_by_policy_name() -> None:
    s = one_pair(100, 50)
    state = RoundRobinState(pe_cursor=0, de_cursor=0, next_side=ReadSide.DE)
    assert place("dualpath", s, limits(alpha=1000), state).placements[0].read_side is ReadSide.DE
    assert place("basic", s, limits(), state).placements[0].read_side is ReadSide.PE
    assert place("dualpath", s, limits(), state).rr_state == state
    with pytest.raises(ConfigError, match="unknown placement policy 'fifo'"):
        place("fifo", s, limits())


def test_inconsistent_snapshots_are_refused() -> None:
    with pytest.raises(KvpathError, match="without a node snapshot"):
        snap([pe("p", 7, 0)], [node(0)], [])
    with pytest.raises(KvpathError, match="duplicate engine ids"):
        snap([pe("p", 0, 0), de("p", 0, 0)], [node(0)], [])
    with pytest.raises(KvpathError, match="hit_tokens=11"):
        PendingRequest("r", 10, 11, 20)
    with pytest.raises(KvpathError, match="role 'storage'"):
        EngineSnapshot("e", "storage", 0, "g", 0, 0)

"""The round function the live dispatcher and the simulator call: missing roles, skipped rounds, windows,
the forced read side, and the colocated least-loaded choice."""

from __future__ import annotations

from services.policy.colocated import pick_cache_aware, pick_least_loaded
from services.policy.round import MIN_WINDOW, RoundState, place_round
from services.policy.snapshot import ROLE_COLOCATED, EngineSnapshot, ReadSide
from tests.reference_placement import place
from tests.unit.policy.snapshots import de, limits, node, pe, req, snap


def test_a_missing_role_is_reported_and_nothing_is_placed() -> None:
    result = place_round("dualpath", (pe("p", 0, 0),), (node(0),), [req("r", 10)], limits(), RoundState())
    assert result.missing_roles == ("decode",)
    assert result.placements == ()
    draining = (pe("p", 0, 0, is_draining=True), de("d", 1, 0))
    result = place_round("basic", draining, (node(0), node(1)), [req("r", 10)], limits(), RoundState())
    assert result.missing_roles == ("prefill",)


def test_a_head_that_fits_nowhere_skips_the_round() -> None:
    engines = (pe("p", 0, 2000), de("d", 1, 0))  # the only PE is above beta
    state = RoundState(window=128)
    result = place_round("dualpath", engines, (node(0), node(1)), [req("r", 10)], limits(beta=1000), state)
    assert result.is_skipped and result.placements == () and result.state == state
    no_room = (pe("p", 0, 0), de("d", 1, 0, free=5))
    result = place_round("dualpath", no_room, (node(0), node(1)), [req("r", 10)], limits(), state)
    assert result.is_skipped


def test_a_small_window_places_what_the_whole_queue_places() -> None:
    engines = (pe("p0", 0, 0), pe("p1", 0, 0), de("d", 1, 0))
    nodes = (node(0), node(1))
    queue = [req(f"r{i}", 100, hit=64) for i in range(40)]
    thresholds = limits(beta=1000)
    expected = place("dualpath", snap(list(engines), list(nodes), queue), thresholds)
    assert 0 < len(expected.placements) < len(queue)
    for window in (1, 3, MIN_WINDOW):
        result = place_round("dualpath", engines, nodes, queue, thresholds, RoundState(window=window))
        assert result.placements == expected.placements
    result = place_round("dualpath", engines, nodes, queue, thresholds, RoundState(window=1))
    assert result.state.window >= len(result.placements)


def test_the_forced_side_overrides_the_policy_only_where_that_side_can_read() -> None:
    engines = (pe("p", 0, 0), de("d", 1, 0))
    queue = [req("r", 200, hit=128)]
    busy_pe_node = (node(0, read_q=10_000), node(1))  # the policy reads on the DE's node
    natural = place_round("dualpath", engines, busy_pe_node, queue, limits(alpha=10**6), RoundState())
    assert natural.placements[0].read_side is ReadSide.DE
    forced = place_round(
        "dualpath", engines, busy_pe_node, queue, limits(alpha=10**6), RoundState(), force_read_side="pe"
    )
    assert (forced.placements[0].read_side, forced.placements[0].read_node) == (ReadSide.PE, 0)
    dead_pe_node = (node(0, is_alive=False), node(1))
    kept = place_round("dualpath", engines, dead_pe_node, queue, limits(), RoundState(), force_read_side="pe")
    assert kept.placements[0].read_side is ReadSide.DE


def test_colocated_picks_the_fewest_tokens_then_requests_then_id() -> None:
    def engine(engine_id: str, tokens: int, requests: int, *, draining: bool = False) -> EngineSnapshot:
        return EngineSnapshot(engine_id, ROLE_COLOCATED, 0, "g", requests, tokens, 0, draining)

    engines = [engine("b", 10, 1), engine("a", 10, 1), engine("c", 5, 9, draining=True), engine("d", 10, 0)]
    assert pick_least_loaded(engines) == "d"
    assert pick_least_loaded(engines[:2]) == "a"
    assert pick_least_loaded(engines[2:3]) is None
    assert pick_least_loaded([pe("p", 0, 0)]) is None  # another role


def test_cache_aware_trades_the_local_prefix_against_load() -> None:
    def engine(engine_id: str, tokens: int) -> EngineSnapshot:
        return EngineSnapshot(engine_id, ROLE_COLOCATED, 0, "g", 1, tokens, 0, False)

    engines = [engine("a", 1000), engine("b", 0)]
    # "a" holds 3000 of the 4000 prompt tokens: 1000 to bring in + 1000 queued beats b's 4000 + 0
    assert pick_cache_aware(engines, {"a": 3000}, 4000) == "a"
    # a hot prefix piles work on its holder until fetching elsewhere is cheaper
    assert pick_cache_aware([engine("a", 3500), engine("b", 0)], {"a": 3000}, 4000) == "b"
    assert pick_cache_aware(engines, {}, 4000) == "b"  # nothing local anywhere: least loaded
    assert pick_cache_aware(engines, {"a": 10**6}, 4000) == "a"  # a hit never exceeds the prompt
    assert pick_cache_aware([], {}, 10) is None

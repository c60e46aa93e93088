"""DE selection (brief 5.3): group level by total tokens; inside a group the Z threshold, low / high sets and
the HBM fit."""

from __future__ import annotations

import pytest

from tests.reference_placement import assign_decode_groups, high_token_threshold, select_decode_engines
from tests.unit.policy.snapshots import de, node, req, snap


def test_group_level_goes_to_least_total_tokens_updated_after_each_request() -> None:
    s = snap(
        [de("x1", 0, 60), de("x2", 0, 40), de("y1", 1, 30), de("y2", 1, 10)],  # totals: d0=100, d1=40
        [node(0), node(1)],
        [],
    )
    requests = [req("r1", 50), req("r2", 50), req("r3", 50), req("r4", 10)]
    queues = assign_decode_groups(requests, s)
    # r1 -> d1 (40 -> 90); r2 -> d1 (90 < 100, -> 140); r3 -> d0 (100 -> 150); r4 -> d1 (140 < 150)
    assert {g: [r.request_id for r in q] for g, q in queues.items()} == {
        "d0": ["r3"],
        "d1": ["r1", "r2", "r4"],
    }


def test_group_totals_skip_draining_engines() -> None:
    s = snap(
        [de("x1", 0, 10), de("x2", 0, 500, is_draining=True), de("y1", 1, 20)],
        [node(0), node(1)],
        [],
    )
    queues = assign_decode_groups([req("r1", 5)], s)
    assert [r.request_id for r in queues["d0"]] == ["r1"]


def test_z_uses_the_prefix_that_fits_total_free_hbm() -> None:
    engines = [de("x", 0, 100, free=100), de("y", 0, 50, free=60)]  # 160 free in all
    queue = [req("r1", 40, hbm=90), req("r2", 30, hbm=70), req("r3", 5, hbm=5)]
    # R = [r1, r2] (90 + 70 = 160); r3 is behind the first request that does not fit, so not in R
    assert high_token_threshold(queue, engines, 1.05) == pytest.approx(1.05 * (40 + 30 + 150) / 2)


def test_low_set_picks_fewest_requests_not_fewest_tokens() -> None:
    s = snap(
        [de("x", 0, 20, seq=1), de("y", 0, 0, seq=3), de("z", 0, 100, seq=0)],
        [node(0)],
        [],
    )
    # Z = 1.05 * (10 + 120) / 3 = 45.5: x (30) and y (10) are low, z (110) is high although it has seq 0
    assert select_decode_engines([req("r1", 10)], s, 1.05) == ("x",)


def test_empty_low_set_falls_back_to_fewest_tokens_in_the_high_set() -> None:
    s = snap([de("x", 0, 200, seq=0), de("y", 0, 190, seq=5)], [node(0)], [])
    # Z = 1.05 * (100 + 390) / 2 = 257.25; x + 100 = 300 and y + 100 = 290 are both high -> fewest tokens
    assert select_decode_engines([req("r1", 100)], s, 1.05) == ("y",)


def test_des_without_room_are_in_neither_set() -> None:
    s = snap([de("x", 0, 0, seq=0, free=5), de("y", 0, 500, seq=9, free=1000)], [node(0)], [])
    assert select_decode_engines([req("r1", 10, hbm=20)], s, 1.05) == ("y",)


def test_loads_update_inside_the_group_round() -> None:
    s = snap([de("x", 0, 0), de("y", 0, 0)], [node(0)], [])
    # both low throughout (Z = 1.05 * 40 / 2 = 21): fewest requests alternates; ties break by tokens, id
    requests = [req(f"r{i}", 10) for i in range(4)]
    assert select_decode_engines(requests, s, 1.05) == ("x", "y", "x", "y")


def test_hbm_fit_stops_the_group_round_in_fifo_order() -> None:
    s = snap([de("x", 0, 0, free=100), de("y", 0, 0, free=60)], [node(0)], [])
    requests = [req("r1", 10, hbm=80), req("r2", 10, hbm=80), req("r3", 10, hbm=10)]
    # r1 -> x (only x has room); r2 fits nowhere (20 and 60 left): the round ends, r3 is not placed either
    assert select_decode_engines(requests, s, 1.05) == ("x", None, None)


def test_a_full_group_does_not_block_another_group() -> None:
    s = snap([de("x", 0, 0, free=10), de("y", 1, 5, free=1000)], [node(0), node(1)], [])
    # r1 -> d0 (total 0 < 5, then 20) and fits no DE there; r2 -> d1 (5 < 20) and is placed
    assert select_decode_engines([req("r1", 20, hbm=50), req("r2", 1)], s, 1.05) == (None, "y")

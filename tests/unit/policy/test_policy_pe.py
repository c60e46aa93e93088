"""PE selection (brief 5.2): beta cap, alpha read-queue categories, fewest tokens, FIFO stop."""

from __future__ import annotations

import random

import pytest

from services.policy.snapshot import ClusterSnapshot
from tests.reference_placement import select_prefill_engines
from tests.unit.policy.snapshots import limits, node, pe, req, snap


def test_category_one_never_gets_a_request() -> None:
    # a starts just under beta on a short-queue node; once the first request puts it over beta it is
    # overloaded, and the next request goes to b on the long-queue node, although a would still be category 2.
    s = snap(
        [pe("a", 0, tok=95), pe("b", 1, tok=50)],
        [node(0, read_q=0), node(1, read_q=500)],
        [req("r1", 10), req("r2", 10), req("r3", 10)],
    )
    assert select_prefill_engines(s, limits(alpha=100, beta=100)) == ("a", "b", "b")


def test_all_engines_over_beta_place_nothing() -> None:
    s = snap([pe("a", 0, tok=101), pe("b", 0, tok=500)], [node(0)], [req("r1", 1)])
    assert select_prefill_engines(s, limits(beta=100)) == ()


def test_short_read_queue_beats_a_less_loaded_long_queue_engine() -> None:
    s = snap(
        [pe("busy_short", 0, tok=80), pe("idle_long", 1, tok=10)],
        [node(0, read_q=100), node(1, read_q=101)],  # alpha=100: node 0 is short (<=), node 1 long
        [req("r1", 5)],
    )
    assert select_prefill_engines(s, limits(alpha=100)) == ("busy_short",)


def test_long_queue_engines_used_when_no_short_one_is_open() -> None:
    s = snap(
        [pe("short_overloaded", 0, tok=2000), pe("long", 1, tok=900)],
        [node(0, read_q=0), node(1, read_q=10_000)],
        [req("r1", 5)],
    )
    assert select_prefill_engines(s, limits(alpha=100, beta=1000)) == ("long",)


def test_fewest_tokens_wins_within_a_category_ties_by_requests_then_id() -> None:
    s = snap(
        [pe("c", 0, tok=30), pe("b", 0, tok=20, seq=3), pe("a", 0, tok=20, seq=3), pe("d", 0, tok=20, seq=1)],
        [node(0)],
        [req("r1", 1)],
    )
    assert select_prefill_engines(s, limits()) == ("d",)
    s2 = snap([pe("b", 0, tok=20), pe("a", 0, tok=20)], [node(0)], [req("r1", 1)])
    assert select_prefill_engines(s2, limits()) == ("a",)


def test_tokens_are_updated_inside_one_fetch() -> None:
    s = snap(
        [pe("a", 0, tok=0), pe("b", 0, tok=5)],
        [node(0)],
        [req("r1", 10), req("r2", 10), req("r3", 10), req("r4", 10)],
    )
    # a: 0 -> 10; b: 5 -> 15; a (10 < 15): 10 -> 20; b (15 < 20)
    assert select_prefill_engines(s, limits()) == ("a", "b", "a", "b")


def test_fetch_stops_at_the_first_request_no_engine_takes_and_keeps_fifo() -> None:
    s = snap(
        [pe("a", 0, tok=60), pe("b", 0, tok=70)],
        [node(0)],
        [req("big1", 50), req("big2", 50), req("small", 1)],
    )
    # big1 -> a (110 > beta), big2 -> b (120 > beta): nobody is open for `small`, which stays queued
    assert select_prefill_engines(s, limits(beta=100)) == ("a", "b")


def test_draining_engine_gets_nothing() -> None:
    s = snap([pe("a", 0, tok=0, is_draining=True), pe("b", 0, tok=50)], [node(0)], [req("r1", 1)])
    assert select_prefill_engines(s, limits()) == ("b",)


def test_node_with_dead_storage_counts_as_long_queue() -> None:
    s = snap(
        [pe("dead_store", 0, tok=0), pe("live", 1, tok=50)],
        [node(0, read_q=0, is_alive=False), node(1, read_q=0)],
        [req("r1", 1)],
    )
    assert select_prefill_engines(s, limits()) == ("live",)


def test_basic_pool_ignores_read_queue_categories() -> None:
    s = snap(
        [pe("busy_short", 0, tok=80), pe("idle_long", 1, tok=10)],
        [node(0, read_q=0), node(1, read_q=10_000)],
        [req("r1", 5)],
    )
    assert select_prefill_engines(s, limits(), use_read_queue_categories=False) == ("idle_long",)


def test_an_engine_exactly_at_beta_is_not_overloaded() -> None:
    s = snap(
        [pe("a", 0, tok=100), pe("b", 0, tok=100)], [node(0)], [req("r1", 1), req("r2", 1), req("r3", 1)]
    )
    # category 1 is tok > beta: both start open; each goes over after one request
    assert select_prefill_engines(s, limits(beta=100)) == ("a", "b")


def reference_pe_fetch(s: ClusterSnapshot, alpha: float, beta: float) -> tuple[str, ...]:
    """The brief's 5.2 pseudo-code, literally (lists rebuilt for every request)."""
    tok = {e.engine_id: e.unfinished_tokens for e in s.engines}
    seq = {e.engine_id: e.num_unfinished for e in s.engines}
    read_q = {n.node: n.read_queue_tokens for n in s.nodes}
    engines = [e for e in s.engines if e.role == "prefill" and not e.is_draining]
    out = []
    for r in s.queue:
        cat2 = [e for e in engines if tok[e.engine_id] <= beta and read_q[e.node] <= alpha]
        cat3 = [e for e in engines if tok[e.engine_id] <= beta and read_q[e.node] > alpha]
        pool = cat2 or cat3
        if not pool:
            break
        e = min(pool, key=lambda x: (tok[x.engine_id], seq[x.engine_id], x.engine_id))
        tok[e.engine_id] += r.prompt_tokens
        seq[e.engine_id] += 1
        out.append(e.engine_id)
    return tuple(out)


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_pseudo_code_on_random_snapshots(seed: int) -> None:
    rng = random.Random(seed)
    nodes = [node(n, read_q=rng.randint(0, 200)) for n in range(rng.randint(1, 4))]
    engines = [
        pe(f"e{i}", rng.randrange(len(nodes)), tok=rng.randint(0, 120), seq=rng.randint(0, 3))
        for i in range(rng.randint(1, 9))
    ]
    queue = [req(f"r{i}", rng.randint(1, 60)) for i in range(rng.randint(0, 30))]
    s = snap(engines, nodes, queue)
    assert select_prefill_engines(s, limits(alpha=100, beta=150)) == reference_pe_fetch(s, 100, 150)

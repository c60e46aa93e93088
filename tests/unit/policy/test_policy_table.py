"""The round function's fast path (`table_placement` over a `LoadTable` updated in place) decides exactly what
the reference rules of `tests/reference_placement.py` decide over a fresh `ClusterSnapshot`, on random
snapshot sequences: loads that grow and shrink, engines that start and stop draining or change group,
storage that dies."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.policy.load_table import LoadTable
from services.policy.round import RoundState, place_round, place_table_round
from services.policy.snapshot import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ClusterSnapshot,
    EngineSnapshot,
    NodeSnapshot,
    PendingRequest,
    RoundRobinState,
)
from services.policy.table_placement import place_window
from services.policy.thresholds import Thresholds
from tests.reference_placement import POLICIES, place

NUM_NODES = 6


def _engine(rng: random.Random, engine_id: str, role: str) -> EngineSnapshot:
    node = rng.randrange(NUM_NODES)
    # few distinct loads, so ties (broken on ids) happen often
    tokens = rng.choice((0, 100, 100, 400, 900, 2000))
    group = f"g{rng.randrange(3)}" if role == ROLE_DECODE else f"p{node}"
    free = rng.choice((0, 300, 1000, 5000)) if role == ROLE_DECODE else 0
    return EngineSnapshot(engine_id, role, node, group, rng.randrange(4), tokens, free, rng.random() < 0.1)


def _queue(rng: random.Random, step: int) -> tuple[PendingRequest, ...]:
    queue = []
    for i in range(rng.randrange(1, 25)):
        prompt = rng.choice((50, 200, 200, 600))
        hit = rng.choice((0, prompt // 2, prompt))
        queue.append(PendingRequest(f"r{step}.{i}", prompt, hit, prompt + rng.choice((0, 100, 800))))
    return tuple(queue)


def _nodes(rng: random.Random) -> dict[int, NodeSnapshot]:
    return {n: NodeSnapshot(n, rng.choice((0, 50, 150, 1000)), rng.random() > 0.15) for n in range(NUM_NODES)}


@pytest.mark.parametrize("seed", range(4))
def test_the_table_decides_what_the_reference_decides_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    engines = {f"pe{i}": _engine(rng, f"pe{i}", ROLE_PREFILL) for i in range(8)}
    engines |= {f"de{i}": _engine(rng, f"de{i}", ROLE_DECODE) for i in range(10)}
    nodes = _nodes(rng)
    table = LoadTable.of(engines.values(), nodes.values())
    rr = {policy: RoundRobinState() for policy in POLICIES}
    for step in range(60):
        for engine_id in rng.sample(sorted(engines), rng.randrange(1, 6)):  # loads change, in place
            fresh = _engine(rng, engine_id, engines[engine_id].role)
            if rng.random() < 0.5:  # only the loads (the simulator's case), else node, group, draining too
                old = engines[engine_id]
                fresh = dataclasses.replace(
                    old, unfinished_tokens=fresh.unfinished_tokens, free_kv_tokens=fresh.free_kv_tokens
                )
            engines[engine_id] = fresh
            table.update_engine(fresh)
        if rng.random() < 0.3:
            nodes = _nodes(rng)
            for n in nodes.values():
                table.update_node(n)
        thresholds = Thresholds(
            rng.choice((0, 100, 10**6)), rng.choice((500, 1500, 4000)), rng.choice((1.0, 1.05))
        )
        queue = _queue(rng, step)
        snapshot = ClusterSnapshot(tuple(engines.values()), tuple(nodes.values()), queue)
        assert set(table.engines()) == set(snapshot.engines)
        for policy in POLICIES:
            expected = place(policy, snapshot, thresholds, rr[policy])
            got = place_window(policy, table, queue, thresholds, rr[policy], is_partial=False)
            assert got == expected, (policy, step)
            rr[policy] = expected.rr_state


@pytest.mark.parametrize("policy", POLICIES)
def test_an_updated_table_and_a_fresh_one_give_the_same_rounds(policy: str) -> None:
    rng = random.Random(7)
    engines = {f"e{i}": _engine(rng, f"e{i}", (ROLE_PREFILL, ROLE_DECODE)[i % 2]) for i in range(20)}
    nodes = _nodes(rng)
    table = LoadTable.of(engines.values(), nodes.values())
    state_fresh = state_table = RoundState(window=2)  # small windows: the doubling path runs too
    for step in range(40):
        engine_id = rng.choice(sorted(engines))
        engines[engine_id] = _engine(rng, engine_id, engines[engine_id].role)
        table.update_engine(engines[engine_id])
        thresholds = Thresholds(100, rng.choice((500, 4000)))
        queue = list(_queue(rng, step))
        fresh = place_round(
            policy, tuple(engines.values()), tuple(nodes.values()), queue, thresholds, state_fresh
        )
        kept = place_table_round(policy, table, queue, thresholds, state_table)
        assert kept == fresh
        state_fresh, state_table = fresh.state, kept.state


def test_a_table_keeps_decode_group_totals_as_engines_move() -> None:
    de = [EngineSnapshot(f"d{i}", ROLE_DECODE, 0, "a", 1, 100 * (i + 1), 10) for i in range(3)]
    table = LoadTable.of(de, [NodeSnapshot(0, 0)])
    assert table.decode_group_tokens == {"a": 600}
    table.update_engine(EngineSnapshot("d0", ROLE_DECODE, 0, "b", 1, 50, 10))  # moves group
    table.update_engine(EngineSnapshot("d1", ROLE_DECODE, 0, "a", 1, 250, 10))  # load grows
    table.update_engine(EngineSnapshot("d2", ROLE_DECODE, 0, "a", 1, 300, 10, is_draining=True))
    assert table.decode_group_tokens == {"a": 250, "b": 50}
    assert table.decode_groups == {"a": [1], "b": [0]}
    assert table.has_live(ROLE_DECODE) and not table.has_live(ROLE_PREFILL)

"""Shortest prefill first (`--prefill-order short-first`): the pure rule, and the engine scheduler admitting
warm turns (few tokens left to compute) ahead of cold prompts, waiting or partly prefilled, with no
prefill overtaken more than its cap (pure: a free-list allocator, no model)."""

from __future__ import annotations

import random

import pytest

from services.engine.config import EngineConfig
from services.engine.scheduler import EngineScheduler
from services.engine.sequence import Sequence
from services.engine.slo_order import ShortFirstOrder, build_prefill_order
from services.policy.batching import AttentionShape, BatchingLimits
from services.policy.quota import QuotaPlanner, RateMeter
from services.policy.short_first import (
    PrefillQueue,
    WaitingPrefill,
    closed,
    next_shortest,
    past_beta_prefix,
    postponements,
    short_first_order,
    work_ahead,
)
from services.policy.snapshot import Placement
from shared.errors import ConfigError
from tests.unit.engine.test_scheduler import FreeList, apply, sched, seq


def test_the_fewest_tokens_go_first_and_none_passes_a_closed_task() -> None:
    queue = [
        WaitingPrefill(3000, 3000),
        WaitingPrefill(100, 100),
        WaitingPrefill(40, 40),
        WaitingPrefill(40, 40),
    ]
    assert next_shortest(queue) == 2  # the earliest of equals
    full = WaitingPrefill(100, 100, postponed_tokens=100)  # shorter ones took its whole allowance
    assert closed(full) and not closed(WaitingPrefill(100, 100, postponed_tokens=99))
    assert next_shortest([WaitingPrefill(3000, 3000), full, WaitingPrefill(40, 40)]) == 1
    assert next_shortest([WaitingPrefill(3000, 3000, 400), WaitingPrefill(1, 1)], ratio=0.1) == 0
    assert next_shortest([WaitingPrefill(3000, 3000, 400), WaitingPrefill(1, 1)], ratio=1.0) == 1
    assert next_shortest([WaitingPrefill(5, 5)], ratio=0.0) == 0


def test_a_queue_the_router_holds_is_offered_shortest_first_up_to_each_closed_task() -> None:
    queue = [
        WaitingPrefill(3000, 3000),
        WaitingPrefill(100, 100),
        WaitingPrefill(40, 40),
        WaitingPrefill(40, 40),
    ]
    assert short_first_order(queue) == [2, 3, 1, 0]
    # the first pick passes a task with 10 tokens of allowance left: closed, it goes next
    nearly = [WaitingPrefill(100, 100, 90), WaitingPrefill(40, 40), WaitingPrefill(20, 20)]
    assert short_first_order(nearly) == [2, 0, 1]
    assert postponements(nearly, [2, 0]) == [20, 20, 0]  # what placing the first two adds
    assert postponements(nearly, [1]) == [40, 0, 0]
    long = [WaitingPrefill(50, 50), WaitingPrefill(10, 10), WaitingPrefill(1, 1)]
    assert short_first_order(long, scan=2) == [1, 0, 2]  # past the scan: arrival order
    assert short_first_order([]) == []


def test_the_work_ahead_of_a_prefill_is_the_shorter_ones_unless_the_list_stops_before_them() -> None:
    assert work_ahead([], 0, 100) == 0  # an empty queue
    assert work_ahead([40, 100, 3100], 3, 100) == 140  # equals go first: they came first
    assert work_ahead([40, 100, 3100], 3, 39) == 0
    assert work_ahead([40, 100, 3100], 3, 5000) == 3240
    assert work_ahead([40, 100], 5, 99) == 40  # the three unlisted have at least 100 left
    assert work_ahead([40, 100], 5, 100) is None  # unknown: they may have 100 left too


def test_past_beta_the_placements_stand_while_each_pe_takes_them_in_turn() -> None:
    """A round with beta lifted placed four requests; the short-first PE p0 runs 200 tokens within beta_s
    and has a 2,900-token prefill: 56 and 150 stand (the second counts the first), 180 then would wait
    206 and ends it, and what came after it in the round does not stand either."""
    queues = {"p0": PrefillQueue([2900], 1, 200.0), "p1": None}  # p1 orders first come, first served
    calls: list[str] = []

    def queue_of(pe: str) -> PrefillQueue | None:
        calls.append(pe)
        return queues[pe]

    placements = [Placement(rid, "p0", "d0", None, None, 0) for rid in ("a", "b", "c", "d")]
    tokens = {"a": 56, "b": 150, "c": 180, "d": 10}
    assert past_beta_prefix(placements, tokens, queue_of) == 2
    assert calls == ["p0"]  # read once per round
    assert queues["p0"] is not None and queues["p0"].left == [56, 150, 2900]
    assert past_beta_prefix([Placement("e", "p1", "d0", None, None, 0)], {"e": 1}, queue_of) == 0
    assert past_beta_prefix([], {}, queue_of) == 0


@pytest.mark.parametrize("seed", range(4))
def test_the_router_offers_first_what_an_engine_admits_first(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        queue = [
            WaitingPrefill(n, n, rng.choice([0, rng.randrange(0, 2 * n)]))
            for n in (rng.randrange(1, 500) for _ in range(rng.randrange(1, 12)))
        ]
        assert short_first_order(queue)[0] == next_shortest(queue)


def short_first(budget: int, ratio: float = 1.0) -> EngineScheduler:
    s = EngineScheduler(FreeList(256), block_size=4, max_num_seqs=8, max_num_batched_tokens=budget)
    s.prefill_order = ShortFirstOrder(ratio)
    s.short_first_ratio = ratio
    return s


def warm(rid: str, n_prompt: int, hit: int) -> Sequence:
    s = seq(rid, n_prompt)
    s.num_hit_tokens = hit  # a stored or cached prefix, loaded, not computed
    return s


def test_a_warm_turn_is_admitted_before_waiting_cold_prompts_which_it_postpones() -> None:
    s = short_first(budget=64)
    cold = [seq(f"cold{i}", 200) for i in range(3)]
    for c in cold:
        s.add(c)
    turn = warm("warm", 210, hit=200)
    s.add(turn)
    plan = s.schedule()
    assert plan.prefill[0].seq.request_id == "warm"
    assert plan.prefill[0].num_tokens == 10 and plan.prefill[0].load_tokens == 200
    assert [c.postponed_tokens for c in cold] == [10, 10, 10]
    assert turn.postponed_tokens == 0


def test_a_warm_turn_goes_ahead_of_a_partly_prefilled_cold_prompt() -> None:
    s = short_first(budget=64)
    cold = seq("cold", 400)
    s.add(cold)
    apply(s.schedule())  # cold has 64 of 400 computed: a partial prefill
    assert cold.is_prefilling and cold.num_computed_tokens == 64
    s.add(warm("warm", 210, hit=200))
    plan = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in plan.prefill] == [("warm", 10), ("cold", 54)]
    assert cold.postponed_tokens == 10


@pytest.mark.parametrize("order", ["short-first", "fcfs"])
def test_on_a_prefill_engine_the_quota_planner_takes_the_warm_turn_ahead_of_a_partial(order: str) -> None:
    """A prefill engine's batch comes from DualPath's compute-quota planner (FIFO packing under a quota and
    a token cap), not the plain budget: the warm turn reaches it ahead of the partly prefilled cold prompt,
    instead of waiting for the cold prompt's last chunk."""
    limits = BatchingLimits(compute_quota_s=1e6, max_num_batched_tokens=64)  # the cap binds
    planner = QuotaPlanner(AttentionShape(num_q_heads=4, head_dim=16), limits)
    s = short_first(budget=64) if order == "short-first" else sched(blocks=256, budget=64)
    s.prefill_planner = planner.plan
    cold = seq("cold", 400)
    s.add(cold)
    apply(s.schedule())
    assert cold.is_prefilling and cold.num_computed_tokens == 64
    s.add(warm("warm", 210, hit=200))
    got = [(c.seq.request_id, c.num_tokens) for c in s.schedule().prefill]
    if order == "fcfs":
        assert got == [("cold", 64)] and cold.postponed_tokens == 0
    else:
        assert got == [("warm", 10), ("cold", 54)] and cold.postponed_tokens == 10


def test_first_come_first_served_keeps_the_partial_first() -> None:
    s = EngineScheduler(FreeList(256), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    cold = seq("cold", 400)
    s.add(cold)
    apply(s.schedule())
    s.add(warm("warm", 210, hit=200))
    assert [c.seq.request_id for c in s.schedule().prefill] == ["cold"]


def test_shorter_prefills_pass_a_cold_prompt_for_at_most_ratio_times_its_compute() -> None:
    """A stream of 10-token warm turns, one per step, against a 1,000-token cold prompt with a fifth of its
    compute as allowance: 20 of them go first (200 tokens), then the cold prompt heads every step's budget
    until its prefill is done."""
    s = short_first(budget=32, ratio=0.2)
    cold = seq("cold", 1000)
    s.add(cold)
    passed = steps = 0
    while not cold.output_token_ids:
        s.add(warm(f"w{steps}", 110, hit=100))
        plan = s.schedule()
        passed += plan.prefill[0].seq is not cold
        apply(plan)
        for done in [q for q in s.running if q is not cold and q.output_token_ids]:
            s.finish(done, "length")  # a turn's answer: out of the way
        steps += 1
    assert cold.postponed_tokens == 200 and passed == 20
    assert steps == 20 + -(-(1000 - 20 * 22) // 32)  # 22 tokens a step while passed, then the whole budget


def test_nothing_is_reordered_across_a_sequence_whose_first_token_is_out() -> None:
    s = short_first(budget=64)
    s.add(seq("cold", 300))
    preempted = seq("preempted", 300)
    preempted.output_token_ids.append(5)
    s.add(preempted)
    s.add(warm("warm", 110, hit=100))
    order = ShortFirstOrder(1.0)
    order(s.waiting, 1)  # from the preempted one on: it stays next
    assert [q.request_id for q in s.waiting] == ["cold", "preempted", "warm"]


def test_the_config_builds_the_order_and_rejects_an_unknown_one() -> None:
    config = EngineConfig(prefill_order="short-first", short_first_ratio=0.5)
    config.validate()
    order = build_prefill_order(config, RateMeter(10.0))
    assert isinstance(order, ShortFirstOrder) and order.ratio == 0.5
    with pytest.raises(ConfigError, match="short-first"):
        EngineConfig(prefill_order="shortest").validate()

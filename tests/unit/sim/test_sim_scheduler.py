"""The simulator's scheduler is the router's: the very round function / `plan_prefill_batch`, and a windowed
round decides exactly what `place` over the whole FIFO decides."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

import loadgen.sim.prefill
import loadgen.sim.scheduler
import services.policy.batching
import services.policy.round
from loadgen.sim.config import SimConfig, resolve
from loadgen.sim.events import EventLoop
from loadgen.sim.lifecycle import ClusterSim
from loadgen.sim.prefill import Work, short_first_offer
from loadgen.sim.requests import SimRequest
from loadgen.sim.scheduler import GlobalScheduler
from loadgen.sim.workload import build_workload
from services.policy.load_table import LoadTable
from services.policy.round import RoundState, place_round
from services.policy.short_first import PrefillQueue
from services.policy.snapshot import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ClusterSnapshot,
    EngineSnapshot,
    NodeSnapshot,
    PendingRequest,
)
from services.policy.thresholds import Thresholds
from tests.reference_placement import POLICIES, place


def test_the_simulator_imports_the_live_policies() -> None:
    # the router's `place_round` builds a `LoadTable` from its snapshots and runs this very function
    assert loadgen.sim.scheduler.place_table_round is services.policy.round.place_table_round
    assert loadgen.sim.prefill.plan_prefill_batch is services.policy.batching.plan_prefill_batch


@pytest.mark.parametrize("policy", POLICIES)
def test_windowed_round_equals_place_over_the_whole_queue(policy: str) -> None:
    # a tiny beta keeps most of 60 agents' requests waiting in the FIFO
    config = SimConfig(policy=policy, gpus_per_node=2, beta_s=0.02, mal="32k", agents=60, max_sim_s=4.0)
    sim = ClusterSim(resolve(config), build_workload(config))
    sim.run()
    scheduler = sim.scheduler
    assert len(scheduler.fifo) > 20
    # loosen beta so a round can place some of the queue, but not all of it
    prompts = [r.prompt_tokens for r in scheduler.fifo]
    beta = max(e.unfinished_tokens for e in sim.pes) + 3 * statistics.median(prompts)
    thresholds = dataclasses.replace(sim.thresholds(), beta_tokens=beta)
    assert isinstance(thresholds, Thresholds)
    engines, nodes = sim.snapshot_parts()
    # the table the scheduler reads, updated only where loads changed, says what fresh snapshots say
    table = sim.load_table()
    assert set(table.engines()) == set(engines) and set(table.node_snapshots()) == set(nodes)
    queue = tuple(r.pending for r in scheduler.fifo)
    rr_state = scheduler.state.rr
    expected = place(policy, ClusterSnapshot(engines, nodes, queue), thresholds, rr_state)
    assert 0 < len(expected.placements) < len(queue)
    for window in (1, 2, 3, 64):
        result = place_round(policy, engines, nodes, queue, thresholds, RoundState(rr_state, window))
        assert result.placements == expected.placements, window
        assert result.state.rr == expected.rr_state
        assert not result.is_skipped and not result.missing_roles


def _request(rid: int, prompt: int, hit: int) -> SimRequest:
    pending = PendingRequest(str(rid), prompt, hit, prompt + 16)
    return SimRequest(rid, 0, prompt, hit, 16, pending, arrival_s=0.0)


@pytest.mark.parametrize("order", ["fcfs", "short-first"])
def test_the_simulated_router_offers_shortest_first_and_past_beta(order: str) -> None:
    """The live router's short-first round on the simulated clock: the PE (5,000 unfinished tokens, over
    beta) orders its queue shortest first and has a 2,900-token prefill, 200 compute tokens within beta_s;
    the warm turn that came after a cold prompt goes to it at once, the cold prompt waits, and the cold
    prompt is charged the warm turn's 56 tokens. First come, first served, both wait."""
    loop = EventLoop()
    engines = (
        EngineSnapshot("p0", ROLE_PREFILL, 0, "node0", 1, 5000),
        EngineSnapshot("d0", ROLE_DECODE, 1, "node1", 0, 0, free_kv_tokens=10**6),
    )
    table = LoadTable.of(engines, (NodeSnapshot(0, 0), NodeSnapshot(1, 0)))
    placed: list[str] = []
    queue = PrefillQueue([2900], 1, 200.0)
    scheduler = GlobalScheduler(
        loop, "dualpath", 0.0, lambda: table, lambda: Thresholds(1e9, 1000.0),
        lambda request, placement: placed.append(placement.request_id),
        prefill_queue=(lambda pe: queue) if order == "short-first" else None,
    )  # fmt: skip
    scheduler.enqueue(_request(1, 3000, 0))
    scheduler.enqueue(_request(2, 3000, 2944))
    loop.run()
    if order == "fcfs":
        assert placed == [] and len(scheduler.fifo) == 2
        return
    assert placed == ["2"] and [r.request_id for r in scheduler.fifo] == ["1"]
    assert scheduler._postponed == {"1": 56}  # the cold prompt was passed by the warm turn's compute
    assert queue.left == [56, 2900]  # what it was sent counts for the next request
    scheduler.enqueue(_request(3, 3000, 2700))  # 300 to compute: 56 would run first, 2,900 would not
    loop.run()
    assert placed == ["2", "3"]
    scheduler.enqueue(_request(4, 3000, 2900))  # 100: 56 ahead of it; then 300 ahead of the cold prompt
    loop.run()
    assert placed == ["2", "3", "4"] and [r.request_id for r in scheduler.fifo] == ["1"]


def test_a_short_first_run_completes_every_turn_and_is_deterministic() -> None:
    config = SimConfig(
        policy="dualpath", config="1P1D", prefill_order="short-first", gpus_per_node=1, beta_s=0.2,
        mal="32k", agents=40, tpot_s=0.001,
    )  # fmt: skip
    workload = build_workload(config)
    raw = ClusterSim(resolve(config), workload).run()
    assert len(raw.records) == workload.num_requests
    assert raw.num_waiting == 0 and all(t == t for t in raw.agent_finish_s)
    again = ClusterSim(resolve(config), build_workload(config)).run()
    assert again.records == raw.records


def test_a_simulated_short_first_pe_packs_shorter_waiting_work_ahead_of_a_partial_until_it_closes() -> None:
    cold = Work(_request(1, 3000, 0), 1000, 2000)
    cold.total, cold.is_first_chunk = 3000, False  # a third prefilled
    long, short = Work(_request(2, 600, 100), 100, 500), Work(_request(3, 150, 100), 100, 50)
    assert short_first_offer([cold, long, short]) == [short, long, cold]
    cold.postponed = 2990  # 10 tokens of its allowance left: the 50-token work passes it, and closes it
    assert short_first_offer([cold, long, short]) == [short, cold, long]

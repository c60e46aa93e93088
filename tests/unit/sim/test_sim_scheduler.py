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
from loadgen.sim.lifecycle import ClusterSim
from loadgen.sim.workload import build_workload
from services.policy.round import RoundState, place_round
from services.policy.snapshot import ClusterSnapshot
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

"""The simulator's scheduler is the router's: the very `place` / `plan_prefill_batch` functions, and its
windowed rounds decide exactly what `place` over the whole FIFO decides."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

import loadgen.sim.prefill
import loadgen.sim.scheduler
import services.engine.batching
import services.router.placement
from loadgen.sim.config import SimConfig, resolve
from loadgen.sim.lifecycle import ClusterSim
from loadgen.sim.workload import build_workload
from services.router.dualpath import ClusterSnapshot, Thresholds
from services.router.placement import POLICIES, place


def test_the_simulator_imports_the_live_policies() -> None:
    assert loadgen.sim.scheduler.place is services.router.placement.place
    assert loadgen.sim.prefill.plan_prefill_batch is services.engine.batching.plan_prefill_batch


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
    whole = ClusterSnapshot(engines, nodes, tuple(r.pending for r in scheduler.fifo))
    expected = place(policy, whole, thresholds, scheduler.rr_state)
    assert 0 < len(expected.placements) < len(scheduler.fifo)
    scheduler._thresholds = lambda: thresholds
    rr_state = scheduler.rr_state
    for window in (1, 2, 3, 64):
        scheduler._window = window
        scheduler.rr_state = rr_state
        assert tuple(scheduler.decide()) == expected.placements, window
        assert scheduler.rr_state == expected.rr_state

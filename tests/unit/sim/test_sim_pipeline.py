"""Layerwise pipeline timing on hand-computed cases, the step model of an EP group, and a whole two-turn
request path through the simulator checked against a timeline computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from loadgen.sim.config import SimConfig, resolve
from loadgen.sim.lifecycle import ClusterSim
from loadgen.sim.models import SimModel
from loadgen.sim.pipeline import RankBatch, layerwise_finish_s, non_layerwise_finish_s, step_timing
from loadgen.sim.requests import RECORD_FIELDS
from loadgen.sim.workload import AgentPlan, Workload
from services.policy.batching import AttentionShape


def test_layerwise_transfer_bound_and_compute_bound() -> None:
    # transfer 2 s per layer, compute 1 s: layer 0 runs 2-3, layer 1 waits for its KV: 4-5, layer 2: 6-7
    assert layerwise_finish_s(0.0, 3, 2.0, 1.0) == pytest.approx(7.0)
    # compute-bound: only the first layer's KV is exposed: 1 + 3 x 2
    assert layerwise_finish_s(10.0, 3, 1.0, 2.0) == pytest.approx(17.0)
    # no KV to load: pure compute
    assert layerwise_finish_s(0.0, 4, 0.0, 0.5) == pytest.approx(2.0)
    # non-layerwise: all KV first, no overlap
    assert non_layerwise_finish_s(0.0, 3, 2.0, 1.0) == pytest.approx(9.0)


def _toy_model(**overrides: object) -> SimModel:
    base = SimModel(
        name="toy",
        description="hand-computable: 2 layers, linear FLOPs only",
        num_layers=2,
        kv_bytes_per_token=2_000_000,  # 1 MB per layer and token
        active_params=1e9,  # 1e9 FLOPs per token and layer
        attention_shape=AttentionShape(1, 1),
        is_expert_parallel=False,
        linear_flops_per_s=1e12,
        attention_flops_per_s=math.inf,  # attention is free
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def test_ep_group_waits_for_the_slowest_rank_and_shares_linear_flops() -> None:
    model = _toy_model(attention_flops_per_s=4.0, active_params=1e12)
    ranks = [
        RankBatch(((0, 1),), 3e9, 0.0),  # attention 4 FLOPs = 1 s; 3 GB over loopback = 3 s
        RankBatch(((0, 3),), 0.0, 1e9),  # attention 4*1*1*6 = 24 FLOPs = 6 s; 1 GB over the network = 0.5 s
    ]
    timing = step_timing(model, ranks, is_layerwise=True, loopback_bytes_per_s=1e9, network_bytes_per_s=2e9)
    # per layer: max attention 6 s + linear 2 x 1e12 x 4 tokens / 2 layers / (2 ranks x 1e12) = 2 s -> 8 s;
    # transfer max(3, 0.5) = 3 s; layerwise over 2 layers: 3 + 8, then max(11, 6) + 8 = 19
    assert timing.compute_s_per_layer == pytest.approx(8.0)
    assert timing.transfer_s_per_layer == pytest.approx(3.0)
    assert timing.duration_s == pytest.approx(19.0)
    assert timing.attention_balance == pytest.approx(6 / 3.5)
    # an idle rank is no balance sample
    idle = step_timing(
        model,
        [ranks[0], RankBatch((), 0, 0)],
        is_layerwise=True,
        loopback_bytes_per_s=1e9,
        network_bytes_per_s=1e9,
    )
    assert idle.attention_balance is None


def _record(run_records: list[tuple[float, ...]], turn: int) -> dict[str, float]:
    row = next(r for r in run_records if int(r[1]) == turn)
    return dict(zip(RECORD_FIELDS, row, strict=True))


@pytest.mark.parametrize(("policy", "layerwise_s"), [("dualpath", 0.358), ("basic", 0.460)])
def test_two_turns_follow_the_hand_computed_timeline(policy: str, layerwise_s: float) -> None:
    config = SimConfig(
        policy=policy,
        gpus_per_node=1,
        cnic_gbit_per_s=8.0,  # B = 1e9 B/s; the SNIC too (s = 1)
        kv_share=1.0,
        fetch_period_s=0.0,
        tpot_s=0.01,
        max_concurrent_reads=0,
    )
    setup = dataclasses.replace(resolve(config), model=_toy_model())
    workload = Workload((AgentPlan((128, 100), (2, 3), (0.0, 0.0)),), (0.0,))
    run = ClusterSim(setup, workload).run()
    first, second = _record(run.records, 0), _record(run.records, 1)
    # turn 1: nothing to read; 2 layers x (1e9 x 128 / 1e12) = 0.256 s of compute -> first token
    assert first["first_token_s"] == pytest.approx(0.256)
    # last layer's 128 x 1 MB to the DE buffer at 1 GB/s (0.128 s), H2D of 256 MB (0.256 s), one 10 ms step
    assert first["second_token_s"] == pytest.approx(0.256 + 0.128 + 0.256 + 0.01)
    assert first["finish_s"] == pytest.approx(0.65)
    # turn 2 at 0.65: context 130 -> 128 hit tokens (whole blocks), 102 computed; reads 256 MB on the PE node
    t2 = 0.65
    assert second["arrival_s"] == pytest.approx(t2) and second["hit_tokens"] == 128
    assert second["read_done_s"] - t2 == pytest.approx(0.256)
    # per layer: KV 128 MB at 1 GB/s = 0.128 s, compute 0.102 s. Layerwise: 0.128 + 0.102, then layer 1's
    # KV at 0.256 + 0.102 = 0.358. Non-layerwise (basic): 2 x 0.128 + 2 x 0.102 = 0.460
    assert second["first_token_s"] - second["read_done_s"] == pytest.approx(layerwise_s)
    assert second["read_side"] == 1.0  # equal (empty) queues: the PE side
    assert run.snic_read_bytes == pytest.approx([256e6, 0.0])

"""`--policy auto` in the simulator (loadgen/sim/auto): the fixed policies keep their paths, auto runs on the
colocated engines, its predictions track the simulated TTFT, on the mixed workload one cost model beats every
fixed rule, a prompt's KV is reusable from its first token on, and an engine prefills in chunks as the live
one does."""

from __future__ import annotations

import pytest

from loadgen.sim.auto.cluster import COLOCATED, ClusterShape, SimCluster
from loadgen.sim.auto.policies import POLICIES
from loadgen.sim.auto.run import compare, gpu_profiles, simulate
from loadgen.sim.auto.workloads import HOLDER_KEY, Scale, build
from services.policy.auto import LOCAL, Plan, Source, enumerate_plans

SMALL = Scale(agents=6, max_turns=8, ampd_sessions=16, pool_docs=8, pool_questions=48, fanin_agents=12)


def test_each_fixed_policy_only_takes_its_own_paths() -> None:
    sessions = build("mix", SMALL, 0)
    allowed = {
        "dualpath": {"remote/storage", "remote/storage-de", "remote/recompute"},
        "basic": {"remote/storage", "remote/recompute"},
        "beluga": {"local/pool", "local/storage", "local/recompute"},
        "route": {"local/route", "local/hbm", "local/storage", "local/recompute"},
    }
    for policy, labels in allowed.items():
        run = simulate(sessions, policy, ClusterShape(), gpu_profiles(), 0, "mix")
        assert set(run.plans) <= labels, (policy, run.plans)
        assert len(run.ttft_s) == sum(len(s.turns) for s in sessions)


def test_auto_uses_several_paths_predicts_ttft_and_wins_the_mix() -> None:
    summary = compare(SMALL, ClusterShape(), gpu_profiles(), workloads=("mix",))
    mix = summary["results"]["mix"]
    best_fixed = min(v for k, v in mix.items() if k != "auto")
    assert mix["auto"] < best_fixed
    plans = summary["plans"]["mix"]["auto"]
    assert set(plans) >= {"local/hbm", "local/pool", "local/recompute"}, plans
    assert summary["ttft_mdape"] < 0.2


def test_auto_runs_on_the_colocated_engines_and_routes_the_fan_in_there() -> None:
    """Auto runs where the live router offers routing: every engine decodes sub-agents, as under `route`."""
    assert POLICIES["auto"][1] == COLOCATED
    summary = compare(SMALL, ClusterShape(), gpu_profiles(), workloads=("fanin",), policies=("route", "auto"))
    plans = summary["plans"]["fanin"]["auto"]
    assert "local/route" in plans and not any(label.startswith("remote/") for label in plans), plans
    fanin = summary["results"]["fanin"]
    assert fanin["auto"] <= 1.05 * fanin["route"]


def test_a_prompt_is_in_the_tiers_from_its_first_token_its_output_once_the_turn_finished() -> None:
    cluster = SimCluster(ClusterShape(topology=COLOCATED, noise=0.0), gpu_profiles(), 0, HOLDER_KEY)
    first = cluster.request("a", "doc", 10_000, 8, None)
    recompute = Plan(LOCAL, Source.RECOMPUTE, "e0-0", "e0-0", 0, "", 0.0, 0.0)
    started = cluster.execute(recompute, first, 0.0, "doc", 9_900)
    cluster.advance(started.first_token_s / 2)  # still prefilling: no tier holds the document
    early = cluster.request("b", "doc", 10_000, 8, None)
    assert (early.storage_hit_tokens, early.pool_hit_tokens, dict(early.resident_tokens)) == (0, 0, {})
    # from the first token on, while "a" still decodes, its prompt is in storage, the pool and its HBM
    assert cluster.decode_end("a", "e0-0") > started.first_token_s
    cluster.advance(started.first_token_s)
    hit = cluster.request("c", "doc", 10_000, 8, None)
    assert (hit.storage_hit_tokens, hit.pool_hit_tokens, dict(hit.resident_tokens)) == (
        9_900,
        9_900,
        {"e0-0": 9_900},
    )
    # the finished turn adds its output; a tier keeps the longest prefix of the key
    cluster.finish("a", "e0-0", "doc", 10_008)
    cluster.advance(started.first_token_s + 1.0)
    later = cluster.request("d", "doc", 20_000, 8, None)
    assert (later.storage_hit_tokens, later.pool_hit_tokens, dict(later.resident_tokens)) == (
        10_008,
        10_008,
        {"e0-0": 10_008},
    )


def test_the_same_seed_gives_the_same_run() -> None:
    sessions = build("pool", SMALL, 3)
    a = simulate(sessions, "auto", ClusterShape(), gpu_profiles(), 3, "pool")
    b = simulate(sessions, "auto", ClusterShape(), gpu_profiles(), 3, "pool")
    assert (a.ttft_s, a.plans) == (b.ttft_s, b.plans)


def test_an_engine_prefills_in_chunks_while_its_decodes_keep_stepping() -> None:
    """As the engine's scheduler: 2500 new tokens in chunks of 1000, every step one chunk plus one token of
    each running decode. A decode with 1000 tokens left waits all three chunks' T_pre; one with 2 left shares
    (and waits) the first two and is gone for the third step. The policy prices the same steps."""
    shape = ClusterShape(topology=COLOCATED, noise=0.0, max_num_batched_tokens=1000)
    cluster = SimCluster(shape, gpu_profiles(), 0, HOLDER_KEY)
    costs, e = cluster.p.costs, cluster.engines["e0-0"]
    e.decodes["long"] = [10.0, 1000.0, 0.01]  # [end, context tokens, seconds per token]: 1000 tokens left
    e.decodes["short"] = [0.02, 500.0, 0.01]  # 2 tokens left
    chunks = [costs.prefill_s(0, 1000, "colocated"), costs.prefill_s(1000, 1000, "colocated")]
    chunks.append(costs.prefill_s(2000, 500, "colocated"))
    both, alone = costs.decode_step_s(2, 1500, "colocated"), costs.decode_step_s(1, 1000, "colocated")
    req = cluster.request("r", "doc", 2500, 4, None)
    snapshot = cluster.snapshot(0.0)
    recompute = Plan(LOCAL, Source.RECOMPUTE, "e0-0", "e0-0", 0, "", 0.0, 0.0)
    started = cluster.execute(recompute, req, 0.0)
    assert started.first_token_s == pytest.approx(sum(chunks) + 2 * both + alone)
    assert e.decodes["long"][0] == pytest.approx(10.0 + sum(chunks))
    assert e.decodes["short"][0] == pytest.approx(0.02 + chunks[0] + chunks[1])
    # the estimator, seeing both decodes running, prices three steps of the two-decode batch
    priced = next(x for x in enumerate_plans(req, snapshot, cluster.p) if x.source is Source.RECOMPUTE)
    assert priced.ttft_s == pytest.approx(sum(chunks) + 3 * both)


def test_a_routed_exchange_waits_for_the_step_its_holder_is_running() -> None:
    """The holder's model thread runs one step at a time and the queued exchanges next: each layer's
    exchange of a routed prefill waits for one step of a busy holder, all of them at most its backlog."""
    cluster = SimCluster(ClusterShape(topology=COLOCATED, noise=0.0), gpu_profiles(), 0, HOLDER_KEY)
    cluster.pin(HOLDER_KEY, 30_000)
    holder, costs = cluster.holder, cluster.p.costs
    requesters = iter(e for e in cluster.engines if e != holder.engine_id)  # an idle one for each request

    def first_token(holder_free_at: float, rid: str) -> float:
        holder.free_at = holder_free_at
        other = next(requesters)
        routed = Plan(LOCAL, Source.ROUTE, other, other, 30_000, holder.engine_id, 0.0, 0.0)
        return cluster.execute(routed, cluster.request(rid, HOLDER_KEY, 30_200, 4, None), 0.0).first_token_s

    idle = first_token(0.0, "idle")
    step = costs.prefill_s(0, cluster.shape.max_num_batched_tokens, "colocated")
    layers = cluster.p.route.shape.num_layers if cluster.p.route is not None else 0
    assert first_token(100.0, "busy") - idle == pytest.approx(layers * step)
    assert first_token(0.004, "short") - idle == pytest.approx(0.004)

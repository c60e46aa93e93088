"""The AMPD cluster model: invariants on hand-made sessions (exact times from a linear cost model), the
policies' local shares, and the paper-scale runner's shape."""

from __future__ import annotations

import pytest

from loadgen.sim.ampd import VARIANTS, paper_attainment
from loadgen.sim.ampd.cluster import AmpdCluster, SimSession
from loadgen.sim.ampd.paper import ANCHOR_RATE, Deployment, kv_capacity_tokens, load_at
from loadgen.sim.ampd.planner import Candidate, candidates, plan, solve
from loadgen.sim.ampd.protocol import colocated_candidates, paper_deployment
from services.policy.ampd import MODE_AMPD, MODE_LOCAL, MODE_REMOTE_RR
from services.policy.ampd_costs import linear_cost_model

COSTS = linear_cost_model(
    prefill_tokens_per_s=1000.0, decode_step_s=0.01, kv_bytes_per_token=1000, link_bytes_per_s={"kv": 1e6}
)


def one(rounds: list[tuple[int, int, float]], ttft: float = 10.0, itl: float = 1.0) -> SimSession:
    return SimSession("s", rounds, ttft, itl)


def test_a_remote_round_reads_the_history_computes_and_sends_the_increment_back() -> None:
    cluster = AmpdCluster(COSTS, num_prefill=1, num_decode=1, mode=MODE_REMOTE_RR, link="kv", reorder=False)
    (s,) = cluster.run([(0.0, one([(100, 3, 0.5), (200, 2, 0.0)]))])
    alpha = 1e-4  # linear_cost_model's link alpha
    assert s.is_done and s.ttfts[0] == pytest.approx(0.1 + alpha + 0.1)  # compute, then 100 tokens back
    # round 2: 103 history tokens in (0.103 s), 0.2 s compute, 200 tokens back (0.2 s)
    assert s.ttfts[1] == pytest.approx(0.103 + 0.2 + 0.2 + 2 * alpha)
    assert s.itl_tokens == 2 + 1 and s.itl_sum_s == pytest.approx(3 * 0.01)
    assert (cluster.counts.local, cluster.counts.remote) == (0, 2)


def test_a_queued_history_read_overlaps_the_previous_compute() -> None:
    cluster = AmpdCluster(COSTS, num_prefill=1, num_decode=1, mode=MODE_REMOTE_RR, link="kv", reorder=False)
    y = SimSession("y", [(100, 1, 0.0), (100, 1, 0.0)], 10.0, 1.0)
    x = SimSession("x", [(2000, 1, 0.0)], 10.0, 1.0)
    cluster.run([(0.0, y), (0.15, x)])
    alpha = 1e-4
    # y's round 2 (101 history tokens) is queued at 0.2001 behind x's compute (0.15-2.15): its 0.101 s read
    # runs during that compute (paper §6), so it waits 1.9499 s, computes 0.1 s and sends 100 tokens back
    assert y.ttfts[1] == pytest.approx((2.15 - 0.2 - alpha) + 0.1 + 0.1 + alpha)
    assert x.ttfts == [pytest.approx(2.0 + 2.0 + alpha)]  # x's first round had no history to read


def test_a_local_prefill_stalls_the_decode_batch_for_exactly_its_duration() -> None:
    cluster = AmpdCluster(COSTS, num_prefill=0, num_decode=1, mode=MODE_LOCAL, link="kv", reorder=False)
    a, b = one([(100, 50, 0.0)]), SimSession("b", [(300, 2, 0.0)], 10.0, 1.0)
    cluster.run([(0.0, a), (0.105, b)])
    # a decodes from t=0.1 in 10 ms steps; b's 0.3 s prefill starts after the step ending at 0.11
    assert a.ttfts == [pytest.approx(0.1)] and b.ttfts == [pytest.approx(0.11 + 0.3 - 0.105)]
    assert a.itl_sum_s == pytest.approx(49 * 0.01 + 0.3) and cluster.counts.local == 2


def test_ampd_routes_remote_with_prefill_slack_and_local_without() -> None:
    slack = AmpdCluster(COSTS, num_prefill=1, num_decode=1, mode=MODE_AMPD, link="kv")
    slack.run([(0.0, one([(100, 2, 0.0)], ttft=10.0))])
    tight = AmpdCluster(COSTS, num_prefill=1, num_decode=1, mode=MODE_AMPD, link="kv")
    tight.run([(0.0, one([(100, 2, 0.1)] * 3, ttft=0.01))])  # the PE's first TTFT breaks alpha x SLO
    assert (slack.counts.local, slack.counts.remote) == (0, 1)
    assert tight.counts.remote == 1 and tight.counts.local == 2


def test_paper_attainment_reports_every_trace_and_policy() -> None:
    out = paper_attainment(["hotpotqa"], n=12, seeds=1)
    assert set(out) == {"hotpotqa"}
    assert set(out["hotpotqa"]) == {"ampd", "disagg-remote", "colocated", "ampd-least-queue"}
    assert all(0.0 <= v <= 1.0 for v in out["hotpotqa"].values())
    assert {"ampd-no-reorder", "ampd-no-routing"} <= VARIANTS.keys()


def test_the_paper_protocol_sweeps_the_rates_and_runs_each_policy_on_its_deployment() -> None:
    assert load_at(ANCHOR_RATE, 0.45) == 0.45 and load_at(0.8, 0.45) == pytest.approx(0.18)  # Fig. 4: 0.8-2.4
    assert colocated_candidates(8) == [Deployment(tp, 0, tp, 8 // tp) for tp in (2, 4, 8)]
    calls: list[tuple[str, str]] = []

    def deploy(trace: str, policy: str) -> Deployment:
        calls.append((trace, policy))
        return Deployment(8, 0, 8, 1) if policy == "colocated" else Deployment(4, 1, 4, 1)

    out = paper_attainment(
        ["hotpotqa"], policies=("ampd", "colocated"), n=6, seeds=1, rates=(0.8,), deploy=deploy
    )
    assert calls == [("hotpotqa", "ampd"), ("hotpotqa", "colocated")] and set(out["hotpotqa"]) == {
        "ampd",
        "colocated",
    }


def test_planner_candidates_fit_the_model_and_use_every_gpu() -> None:
    deps = candidates(8)
    assert deps and all(d.gpus == 8 and d.tp_prefill >= 2 and d.tp_decode >= 2 for d in deps)  # 70B: TP >= 2
    assert Deployment(4, 1, 4, 1) in deps and Deployment(2, 2, 4, 1) in deps


def test_the_milp_picks_the_min_max_candidate() -> None:
    def cand(pre: float, dec: float) -> Candidate:
        return Candidate(Deployment(4, 1, 4, 1), pre, dec, 0.0)

    cands = [cand(3.0, 0.5), cand(1.2, 1.1), cand(0.9, 1.4), cand(float("inf"), 0.1)]
    assert solve(cands) == 1
    out = plan("hotpotqa", 8, n=10, load=0.3, seed=0)
    z = [max(r["tau_pre"], r["tau_dec"]) for r in (out["chosen"], *out["top"])]
    assert out["candidates"] == len(candidates(8)) and z[0] == z[1] <= z[2]


def test_a_session_waits_for_kv_memory_and_its_wait_counts_in_its_ttft() -> None:
    cluster = AmpdCluster(
        COSTS, num_prefill=0, num_decode=1, mode=MODE_LOCAL, link="kv", reorder=False, kv_capacity_tokens=250
    )
    a, b = SimSession("a", [(100, 3, 0.0)], 10.0, 1.0), SimSession("b", [(200, 1, 0.0)], 10.0, 1.0)
    cluster.run([(0.0, a), (0.05, b)])
    # a holds 101 tokens from binding; b's 201 do not fit beside them until a's last token at 0.12
    assert cluster.counts.admission_waits == 1 and b.ttfts == [pytest.approx(0.12 + 0.2 - 0.05)]
    assert cluster.decodes[0].kv_tokens == 0 and cluster.counts.over_capacity == 0


def test_binding_reads_the_live_occupancy_a_finished_session_frees() -> None:
    cluster = AmpdCluster(COSTS, num_prefill=0, num_decode=2, mode=MODE_LOCAL, link="kv", reorder=False)
    a, b = SimSession("a", [(100, 3, 0.0)], 10.0, 1.0), SimSession("b", [(100, 3, 0.0)], 10.0, 1.0)
    cluster.run([(0.0, a), (1.0, b)])
    assert a.engine is not None and b.engine is a.engine  # de0 is empty again when b arrives


def test_kv_capacity_is_what_the_gpus_hold_beside_the_weights() -> None:
    # brief §7.2: tp x 96 GB x 0.9 - 141 GB of Llama-3.1-70B weights, 320 KiB per token
    assert kv_capacity_tokens(1) == 0 and kv_capacity_tokens(2) == int((172.8e9 - 141.2e9) // (320 * 1024))


def test_a_bound_session_outgrowing_its_engine_is_counted_not_evicted() -> None:
    cluster = AmpdCluster(
        COSTS, num_prefill=0, num_decode=1, mode=MODE_LOCAL, link="kv", reorder=False, kv_capacity_tokens=150
    )
    (a,) = cluster.run([(0.0, SimSession("a", [(100, 2, 0.0), (100, 2, 0.0)], 10.0, 1.0))])
    assert a.is_done and cluster.counts.over_capacity == 1 and cluster.counts.admission_waits == 0


@pytest.mark.parametrize("short_first", [False, True])
def test_short_first_runs_the_shorter_queued_prefill_first_on_a_decode_engine(short_first: bool) -> None:
    """The engines' `--prefill-order short-first` in the model (the same pure rule): while `a` prefills,
    `b` (2,000 tokens) and then `c` (100) queue on the DE; shortest first runs `c` before `b`."""
    cluster = AmpdCluster(
        COSTS, num_prefill=0, num_decode=1, mode=MODE_LOCAL, link="kv", reorder=False, short_first=short_first
    )
    a, b, c = (SimSession(n, [(t, 1, 0.0)], 10.0, 1.0) for n, t in (("a", 2000), ("b", 2000), ("c", 100)))
    cluster.run([(0.0, a), (0.05, b), (0.06, c)])
    assert a.ttfts == [pytest.approx(2.0)]
    if short_first:
        assert c.ttfts == [pytest.approx(2.1 - 0.06)] and b.ttfts == [pytest.approx(4.1 - 0.05)]
    else:
        assert b.ttfts == [pytest.approx(4.0 - 0.05)] and c.ttfts == [pytest.approx(4.1 - 0.06)]


def test_the_short_first_variant_is_tuned_over_colocated_deployments() -> None:
    variant = VARIANTS["colocated-short-first"]
    assert variant.short_first and variant.mode == MODE_LOCAL and not variant.reorder
    assert paper_deployment("toolbench", "colocated-short-first").dp_prefill == 0  # no prefill engines

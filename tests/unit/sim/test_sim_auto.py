"""`--policy auto` in the simulator (loadgen/sim/auto): the fixed policies keep their paths, auto's
predictions track the simulated TTFT, and on the mixed workload one cost model beats every fixed rule."""

from __future__ import annotations

from loadgen.sim.auto.cluster import ClusterShape
from loadgen.sim.auto.run import compare, gpu_profiles, simulate
from loadgen.sim.auto.workloads import Scale, build

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
    assert len(summary["plans"]["mix"]["auto"]) >= 4  # hbm, pool, recompute, local and remote at least
    assert summary["ttft_mdape"] < 0.2


def test_the_same_seed_gives_the_same_run() -> None:
    sessions = build("pool", SMALL, 3)
    a = simulate(sessions, "auto", ClusterShape(), gpu_profiles(), 3, "pool")
    b = simulate(sessions, "auto", ClusterShape(), gpu_profiles(), 3, "pool")
    assert (a.ttft_s, a.plans) == (b.ttft_s, b.plans)

"""`kvpath loadgen sim --sweep auto` (every policy on the five workloads) and `--policy auto` (auto alone,
with a sample of its decisions explained)."""

from __future__ import annotations

import argparse
from typing import Any

from loadgen.sim.auto.cluster import ClusterShape
from loadgen.sim.auto.policies import POLICIES
from loadgen.sim.auto.report import format_comparison
from loadgen.sim.auto.run import compare, gpu_profiles
from loadgen.sim.auto.workloads import Scale


def run_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    seed = int(getattr(args, "seed", None) or 0)
    policies = tuple(POLICIES) if args.sweep == "auto" else ("auto",)
    summary = compare(Scale(), ClusterShape(), gpu_profiles(), seed=seed, policies=policies)
    text = format_comparison(
        summary, "simulated (4 colocated engines, or 2 nodes x (1 PE + 1 DE) for P/D policies; H100-class)"
    )
    plans = summary["plans"]
    text += "\nplans auto chose: " + "; ".join(f"{w}: {p.get('auto', {})}" for w, p in plans.items())
    return summary, text

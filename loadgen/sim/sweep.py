"""Experiments made of several simulated runs, each returning a JSON-ready dict with the paper's numbers:

* `figure8`: Basic vs DualPath over 1P1D / 2P1D / 1P2D (paper 7.8: mean speedup 1.64, max 2.46; Basic 1P1D
  ~ Basic 1P2D, DualPath 1P1D ~ Basic 2P1D, DualPath 2P1D ~ DualPath 1P2D).
* `ablation`: Basic, + layerwise prefill, + dual-path loading (round robin), + the scheduler (paper 7.10:
  JCT -17.21%, -38.19%, -45.62%).
* `scheduler_cost`: the scheduler's CPU per decision on a large cluster (paper 7.12: 48P96D, 1,152 GPUs,
  under 10 cores).
* `capacity`: the highest online APS meeting the SLO, per policy (paper 7.9: DualPath/Basic 1.67x for
  DS 27B, 2.25x for DS 660B).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from loadgen.sim.config import SimConfig, resolve
from loadgen.sim.lifecycle import ClusterSim
from loadgen.sim.simulate import simulate
from loadgen.sim.workload import build_workload

Progress = Callable[[str], None]
FIGURE8_CONFIGS = ("1P1D", "2P1D", "1P2D")
FIGURE8_PAIRS: tuple[tuple[str, str, str, str], ...] = (
    ("basic", "1P1D", "basic", "1P2D"),
    ("dualpath", "1P1D", "basic", "2P1D"),
    ("dualpath", "2P1D", "dualpath", "1P2D"),
)
ABLATION = (  # (step, policy, layerwise)
    ("basic", "basic", "off"),
    ("+layerwise", "basic", "on"),
    ("+dual path (round robin)", "dualpath-rr", "on"),
    ("+scheduler (DualPath)", "dualpath", "on"),
)
PAPER_ABLATION_REDUCTION = (0.0, 0.1721, 0.3819, 0.4562)
# paper Table 3: 48P96D finishes 48K agents (x 157 turns on the 64K trace) in 3,201 s
PAPER_48P96D_PLACEMENTS_PER_S = 49152 * 157 / 3201


def _quiet(_: str) -> None:
    return None


def _jct(result: dict[str, Any]) -> float:
    value = result["jct"]["all_agents_s"]
    if value is None:
        raise ValueError("an offline run did not finish every agent (raise --max-sim-s or leave it 0)")
    return float(value)


def figure8(base: SimConfig, progress: Progress = _quiet) -> dict[str, Any]:
    jct: dict[str, dict[str, float]] = {"basic": {}, "dualpath": {}}
    runs = []
    for config in FIGURE8_CONFIGS:
        for policy in ("basic", "dualpath"):
            result = simulate(dataclasses.replace(base, policy=policy, config=config, mode="offline"))
            jct[policy][config] = _jct(result)
            runs.append(result)
            progress(f"{policy} {config}: JCT {jct[policy][config]:.1f} s")
    speedups = {c: jct["basic"][c] / jct["dualpath"][c] for c in FIGURE8_CONFIGS}
    pairs = {f"{a} {ca} / {b} {cb}": jct[a][ca] / jct[b][cb] for a, ca, b, cb in FIGURE8_PAIRS}
    return {
        "experiment": "figure8",
        "jct_s": jct,
        "speedup": speedups,
        "speedup_mean": statistics.fmean(speedups.values()),
        "speedup_max": max(speedups.values()),
        "pairs": pairs,
        "paper": {"speedup_mean": 1.64, "speedup_max": 2.46, "pairs": 1.0},
        "runs": runs,
    }


def ablation(base: SimConfig, progress: Progress = _quiet) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for (name, policy, layerwise), paper in zip(ABLATION, PAPER_ABLATION_REDUCTION, strict=True):
        result = simulate(dataclasses.replace(base, mode="offline", policy=policy, layerwise=layerwise))
        jct = _jct(result)
        rows.append({"step": name, "jct_s": jct, "paper_reduction": paper, "run": result})
        progress(f"{name}: JCT {jct:.1f} s")
    for row in rows:
        row["reduction"] = 1 - row["jct_s"] / rows[0]["jct_s"]
    return {"experiment": "ablation", "steps": rows}


def _fresh_snapshot_s(sim: ClusterSim, repeats: int = 20) -> float:
    """What building every engine's snapshot from scratch costs (the live router rebuilds it each round)."""
    started = time.perf_counter()
    for _ in range(repeats):
        sim.snapshot_parts()
    return (time.perf_counter() - started) / repeats


def scheduler_cost(base: SimConfig, progress: Progress = _quiet) -> dict[str, Any]:
    """Run `base` (typically 48P96D with 48K agents and a `max_sim_s` horizon) and time the scheduler."""
    setup = resolve(base)
    sim = ClusterSim(setup, build_workload(base))
    raw = sim.run()
    cost = raw.scheduler
    fresh_s = _fresh_snapshot_s(sim)
    # the live router runs every round (no skipping) and rebuilds the whole snapshot in each
    worst_s = cost.seconds + (cost.num_rounds + cost.num_skipped) * fresh_s
    progress(f"{cost.num_rounds} rounds, {cost.num_placed} placements over {raw.end_s:.1f} simulated s")
    engines = setup.num_nodes * setup.gpus_per_node
    return {
        "experiment": "scheduler_cost",
        "config": setup.pd_label,
        "gpus": engines,
        "agents": len(raw.agent_arrival_s),
        "simulated_s": raw.end_s,
        "rounds": cost.num_rounds,
        "skipped_rounds": cost.num_skipped,
        "placements": cost.num_placed,
        "place_cpu_s": cost.place_seconds,
        "round_cpu_s": cost.seconds,
        "us_per_placement": 1e6 * cost.seconds / max(1, cost.num_placed),
        "place_us_per_placement": 1e6 * cost.place_seconds / max(1, cost.num_placed),
        "max_round_ms": 1e3 * cost.max_round_s,
        "fresh_snapshot_ms": 1e3 * fresh_s,
        "cores": cost.seconds / raw.end_s if raw.end_s else None,
        "cores_rebuilding_snapshots": worst_s / raw.end_s if raw.end_s else None,
        "placements_per_s": cost.num_placed / raw.end_s if raw.end_s else None,
        "cores_at_paper_rate": worst_s / max(1, cost.num_placed) * PAPER_48P96D_PLACEMENTS_PER_S,
        "paper": {"gpus": 1152, "cores_under": 10, "placements_per_s": PAPER_48P96D_PLACEMENTS_PER_S},
    }


def meets_slo(result: dict[str, Any], ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """Online SLO over the run's last window: mean TTFT and mean TPOT within the SLO, and no request left
    waiting for a placement longer than the TTFT SLO (an overloaded queue hides its TTFTs otherwise)."""
    window = result.get("latency_last_window") or {}
    if not window.get("requests"):
        return False
    ttft, tpot = window["ttft_s"]["mean"], window["tpot_s"]["mean"]
    oldest = result["scheduler"]["oldest_waiting_s"]
    return ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s) and oldest <= ttft_slo_s


def _capacity_of(base: SimConfig, policy: str, steps: int, progress: Progress) -> dict[str, Any]:
    def ok(aps: float) -> bool:
        result = simulate(dataclasses.replace(base, mode="online", policy=policy, aps=aps))
        passed = meets_slo(result, base.ttft_slo_s, base.tpot_slo_s)
        progress(f"{policy} at {aps:.4g} APS: {'meets' if passed else 'misses'} the SLO")
        return passed

    low, high = 0.0, base.aps
    while ok(high):
        low, high = high, 2 * high
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return {"policy": policy, "aps": low, "first_failing_aps": high}


def capacity(base: SimConfig, steps: int = 4, progress: Progress = _quiet) -> dict[str, Any]:
    """APS capacity of Basic and DualPath: double from `base.aps` until the SLO breaks, then bisect."""
    if base.aps <= 0:
        raise ValueError("capacity needs --aps > 0 as the first rate to try")
    rows = {p: _capacity_of(base, p, steps, progress) for p in ("basic", "dualpath")}
    basic = rows["basic"]["aps"]
    return {
        "experiment": "capacity",
        "capacity": rows,
        "ratio": rows["dualpath"]["aps"] / basic if basic else None,
        "paper": {"ratio_ds27b": 1.67, "ratio_ds660b": 2.25},
    }

"""Tables of the experiments in `loadgen/sim/sweep.py`, next to the paper's numbers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]


def _figure8(result: dict[str, Any]) -> list[str]:
    jct, speedup = result["jct_s"], result["speedup"]
    setup = result["runs"][0]["setup"]
    lines = [f"Figure 8: {setup['model']}, {setup['agents']} agents, MAL {setup['mal']}, offline JCT"]
    rows = [
        (c, f"{jct['basic'][c]:.1f} s", f"{jct['dualpath'][c]:.1f} s", f"{speedup[c]:.2f}x") for c in speedup
    ]
    lines += _table(("P/D", "Basic", "DualPath", "speedup"), rows)
    paper = result["paper"]
    lines.append(
        f"speedup mean {result['speedup_mean']:.2f}x (paper {paper['speedup_mean']}x), "
        f"max {result['speedup_max']:.2f}x (paper {paper['speedup_max']}x)"
    )
    lines += [f"{name} = {ratio:.3f} (paper: alike)" for name, ratio in result["pairs"].items()]
    return lines


def _ablation(result: dict[str, Any]) -> list[str]:
    setup = result["steps"][0]["run"]["setup"]
    lines = [f"Ablation: {setup['model']} {setup['config']}, {setup['agents']} agents, MAL {setup['mal']}"]
    rows = [
        (s["step"], f"{s['jct_s']:.1f} s", f"{s['reduction']:.1%}", f"{s['paper_reduction']:.1%}")
        for s in result["steps"]
    ]
    return lines + _table(("step", "JCT", "JCT reduction", "paper"), rows)


def _cost(result: dict[str, Any]) -> list[str]:
    return [
        f"Scheduler cost: {result['config']} ({result['gpus']} GPUs), {result['agents']} agents, "
        f"{result['simulated_s']:.1f} simulated s",
        f"rounds {result['rounds']} (+{result['skipped_rounds']} skipped: nothing placeable), "
        f"placements {result['placements']} ({result['placements_per_s']:.0f}/s)",
        f"place(): {result['place_us_per_placement']:.1f} us per placement; whole round (snapshot, "
        f"thresholds, place): {result['us_per_placement']:.1f} us per placement, "
        f"longest round {result['max_round_ms']:.1f} ms",
        f"cores at the simulated pace: {result['cores']:.3f} (every round rebuilding all "
        f"{result['gpus']} engine snapshots, {result['fresh_snapshot_ms']:.2f} ms each: "
        f"{result['cores_rebuilding_snapshots']:.3f}); paper: under {result['paper']['cores_under']} cores",
        f"at the paper's 48P96D pace ({result['paper']['placements_per_s']:.0f} placements/s), rebuilding "
        f"snapshots: {result['cores_at_paper_rate']:.3f} cores",
    ]


def _capacity(result: dict[str, Any]) -> list[str]:
    rows = [(p, f"{c['aps']:.4g}", f"{c['first_failing_aps']:.4g}") for p, c in result["capacity"].items()]
    lines = ["APS capacity (last-window mean TTFT and TPOT within the SLO)"]
    lines += _table(("policy", "meets SLO", "misses SLO"), rows)
    ratio = result["ratio"]
    paper = result["paper"]
    lines.append(
        f"DualPath / Basic: {'-' if ratio is None else f'{ratio:.2f}x'} "
        f"(paper {paper['ratio_ds27b']}x DS 27B, {paper['ratio_ds660b']}x DS 660B)"
    )
    return lines


def format_experiment(result: dict[str, Any]) -> str:
    formatter = {"figure8": _figure8, "ablation": _ablation, "scheduler_cost": _cost, "capacity": _capacity}
    return "\n".join(formatter[result["experiment"]](result))

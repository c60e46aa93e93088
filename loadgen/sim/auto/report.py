"""The comparison's table, and a sample of `auto`'s decisions explained (pure formatting)."""

from __future__ import annotations

from typing import Any

from services.policy.auto import Decision


def format_comparison(summary: dict[str, Any], title: str = "simulated") -> str:
    """One row per workload, one column per policy (lower is better), auto's ratio to the best fixed one."""
    results: dict[str, dict[str, float]] = summary["results"]
    policies = list(next(iter(results.values())).keys()) if results else []
    lines = [f"{title}: score per workload (mean JCT s; ampd: 1 - SLO attainment), lower is better"]
    lines.append(f"{'workload':9s} " + " ".join(f"{p:>11s}" for p in policies) + "   auto/best fixed")
    for workload, row in results.items():
        fixed = [v for k, v in row.items() if k != "auto"]
        best = min(fixed) if fixed else 0.0
        ratio = f"{row['auto'] / best:.3f}" if fixed and best > 0 and "auto" in row else "-"
        cells = " ".join(f"{row[p]:11.3f}" for p in policies)
        lines.append(f"{workload:9s} {cells}   {ratio}")
    mdape = summary.get("ttft_mdape")
    if mdape is not None:
        lines.append(f"auto's predicted vs measured TTFT, median absolute percentage error: {mdape:.1%}")
    return "\n".join(lines)


def explain(decision: Decision, measured_ttft_s: float | None = None) -> str:
    """One decision as a line: the plan, its predicted TTFT and harm, the runner-up, the measured TTFT."""
    c = decision.chosen
    engines = (
        c.decode_engine if c.prefill_engine == c.decode_engine else f"{c.prefill_engine}->{c.decode_engine}"
    )
    text = (
        f"{c.label:18s} on {engines:14s} hit {c.hit_tokens:6d} from {c.source_at or '-':10s} "
        f"TTFT {c.ttft_s * 1e3:8.1f} ms + harm {c.harm_s * 1e3:7.1f} ms"
    )
    if decision.runner_up is not None:
        r = decision.runner_up
        text += f" | runner-up {r.label} {r.ttft_s * 1e3:.1f} + {r.harm_s * 1e3:.1f} ms"
    if measured_ttft_s is not None:
        text += f" | measured TTFT {measured_ttft_s * 1e3:.1f} ms"
    return text + ("" if decision.meets_slo else " (misses SLO)")

"""`simulate(config)`: one run of the cluster simulator, summarized; `format_summary` prints it as a table."""

from __future__ import annotations

from typing import Any

from loadgen.sim.config import SimConfig, resolve
from loadgen.sim.lifecycle import ClusterSim, RawRun
from loadgen.sim.results import summarize
from loadgen.sim.workload import Workload, build_workload


def simulate_raw(config: SimConfig, workload: Workload | None = None) -> tuple[RawRun, dict[str, Any]]:
    """Run `config` on `workload` (default: the one `config` describes); the raw run and its summary."""
    setup = resolve(config)
    run = ClusterSim(setup, workload or build_workload(config)).run()
    return run, summarize(run, setup)


def simulate(config: SimConfig, workload: Workload | None = None) -> dict[str, Any]:
    return simulate_raw(config, workload)[1]


def _fmt(value: Any, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.{digits}g}{unit}"


def format_summary(result: dict[str, Any]) -> str:
    s, lat, jct = result["setup"], result["latency"], result["jct"]
    bal, sched, traffic = result["balance"], result["scheduler"], result["traffic"]
    title = f"{s['model']} {s['config']} {s['policy']}" + (" (oracle)" if s["oracle"] else "")
    title += f", {s['mode']}, {s['agents']} agents, MAL {s['mal']}" + (
        f", {s['aps']} APS" if s["aps"] else ""
    )
    rows = [("run", title)]
    if s["mode"] == "offline":
        rows.append(("JCT", _fmt(jct["all_agents_s"], " s", digits=5)))
    rows.append(("requests", f"{lat.get('requests', 0)} (hit rate {_fmt(lat.get('hit_rate'), digits=4)})"))
    if lat.get("requests"):
        rows += [
            ("TTFT mean / p99", f"{_fmt(lat['ttft_s']['mean'], ' s')} / {_fmt(lat['ttft_s']['p99'], ' s')}"),
            ("TTST mean", _fmt(lat["ttst_s"]["mean"], " s")),
            ("TPOT mean", _fmt(lat["tpot_s"]["mean"], " ms", 1e3)),
            (
                "TTFT breakdown",
                "  ".join(f"{k[:-2]} {_fmt(v, ' s')}" for k, v in lat["ttft_breakdown_s"].items()),
            ),
        ]
    if "latency_last_window" in result and result["latency_last_window"].get("requests"):
        window = result["latency_last_window"]
        rows.append(
            ("TTFT last window", f"{_fmt(window['ttft_s']['mean'], ' s')} over {window['requests']} requests")
        )
    links = traffic["links"]
    rows += [
        (
            "SNIC max/avg",
            f"{_fmt(bal['storage_max_over_avg'])} (worst window {_fmt(bal['storage_max_over_avg_worst'])})",
        ),
        ("attention max/avg", _fmt(bal["attention_max_over_avg"])),
        ("read on DE side", f"{traffic['de_read_share']:.1%}"),
        (
            "SNIC read GB/s",
            f"PE nodes {_fmt(links['pe_snic_read']['mean_bytes_per_s'], '', 1e-9)}, "
            f"DE nodes {_fmt(links['de_snic_read']['mean_bytes_per_s'], '', 1e-9)} (mean per node)",
        ),
        (
            "peak link use",
            ", ".join(f"{k} {v['max_utilization']:.0%}" for k, v in links.items() if "snic" not in k),
        ),
        (
            "scheduler",
            f"{sched['rounds']} rounds, {_fmt(sched['us_per_placement'], ' us')}/placement, "
            f"{_fmt(sched['cores_at_sim_speed'])} cores at simulated speed",
        ),
        (
            "simulated",
            f"{_fmt(result['sim']['end_s'], ' s', digits=5)} in {_fmt(result['sim']['wall_s'], ' s')} wall",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

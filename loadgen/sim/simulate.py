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


Rows = list[tuple[str, str]]


def _latency_rows(result: dict[str, Any]) -> Rows:
    s, lat, jct = result["setup"], result["latency"], result["jct"]
    title = f"{s['model']} {s['config']} {s['policy']}" + (" (oracle)" if s["oracle"] else "")
    title += f", {s['mode']}, {s['agents']} agents, MAL {s['mal']}"
    title += f", {s['aps']} APS" if s["aps"] else ""
    rows = [("run", title)]
    if s["mode"] == "offline":
        rows.append(("JCT", _fmt(jct["all_agents_s"], " s", digits=5)))
    rows.append(("requests", f"{lat.get('requests', 0)} (hit rate {_fmt(lat.get('hit_rate'), digits=4)})"))
    if lat.get("requests"):
        ttft = lat["ttft_s"]
        stages = "  ".join(f"{k[:-2]} {_fmt(v, ' s')}" for k, v in lat["ttft_breakdown_s"].items())
        rows += [
            ("TTFT mean / p99", f"{_fmt(ttft['mean'], ' s')} / {_fmt(ttft['p99'], ' s')}"),
            ("TTST mean", _fmt(lat["ttst_s"]["mean"], " s")),
            ("TPOT mean", _fmt(lat["tpot_s"]["mean"], " ms", 1e3)),
            ("TTFT breakdown", stages),
        ]
    window = result.get("latency_last_window") or {}
    if window.get("requests"):
        rows.append(
            ("TTFT last window", f"{_fmt(window['ttft_s']['mean'], ' s')} over {window['requests']} requests")
        )
    return rows


def _resource_rows(result: dict[str, Any]) -> Rows:
    bal, sched, traffic = result["balance"], result["scheduler"], result["traffic"]
    links = traffic["links"]
    per_node = (
        f"PE nodes {_fmt(links['pe_snic_read']['mean_bytes_per_s'], '', 1e-9)}, "
        f"DE nodes {_fmt(links['de_snic_read']['mean_bytes_per_s'], '', 1e-9)} (mean per node)"
    )
    sim = result["sim"]
    return [
        (
            "SNIC max/avg",
            f"{_fmt(bal['storage_max_over_avg'])} (worst {_fmt(bal['storage_max_over_avg_worst'])})",
        ),
        ("attention max/avg", _fmt(bal["attention_max_over_avg"])),
        ("read on DE side", f"{traffic['de_read_share']:.1%}"),
        ("SNIC read GB/s", per_node),
        ("peak link use", _peak_use(result)),
        (
            "scheduler",
            f"{sched['rounds']} rounds, {_fmt(sched['us_per_placement'], ' us')}/placement, "
            f"{_fmt(sched['cores_at_sim_speed'])} cores at simulated speed",
        ),
        ("simulated", f"{_fmt(sim['end_s'], ' s', digits=5)} in {_fmt(sim['wall_s'], ' s')} wall"),
    ]


def _peak_use(result: dict[str, Any]) -> str:
    if result["setup"]["oracle"]:
        return "- (oracle: I/O takes no time)"
    links = result["traffic"]["links"]
    return ", ".join(f"{k} {v['max_utilization']:.0%}" for k, v in links.items() if "snic" not in k)


def format_summary(result: dict[str, Any]) -> str:
    rows = _latency_rows(result) + _resource_rows(result)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

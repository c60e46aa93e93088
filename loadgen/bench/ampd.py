"""`kvpath bench ampd`: AMPD vs always-remote disaggregation vs colocated serving, SLO attainment, one run.

Live: one real `kvpath up` cluster per policy with the same engine count (AMPD and disagg-remote: one
prefill and one decode engine; colocated: two session engines that prefill every turn themselves), each
replaying the four AMPD traces (Table 1 synthesized by loadgen, lengths scaled for the CPU, tool latencies
between rounds) online at the same Poisson session rate, every request carrying the same TTFT / ITL SLOs.
`kvpath profile` runs first and its cost model feeds the router's Algorithm 1 and every engine's
Algorithm 2. A session meets its SLO when every round's TTFT and the session's mean ITL are under the
thresholds (brief §8 #1). Reported per trace and policy: SLO attainment, TTFT and ITL p50/p90, the share
of prefills run locally (from the router's route counter).

With `--sim` the paper-scale simulator (`loadgen/sim/ampd/`, up to 4 x 8 GPUs, the brief's cost models)
runs the same policies under the paper's protocol (`sim_attainment`, mean over Fig. 4's five rates, on the
deployments in `sim_deployments`), the Fig. 5 ablation (`sim_ablation`) and the Fig. 6 alpha / beta sweep
(`sim_sensitivity`), both at 2 req/s; the SLO is the same one (`services/policy/ampd_slo.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadgen.bench.scrape import scrape
from loadgen.config import ReplayConfig
from loadgen.formats import kvpath, load_trace
from loadgen.profiles import PROFILES, SynthOptions, synthesize
from loadgen.runner import run_replay
from loadgen.sim.ampd.paper import Deployment
from services.policy.ampd_slo import RoundLatency, SessionSlo, attainment
from services.up.process import UpProcess

TRACES = ("toolbench", "gaia", "hotpotqa", "dureader")
POLICIES: dict[str, tuple[str, ...]] = {  # bench name -> `kvpath up` flags (same engine count)
    "ampd": ("--policy", "ampd", "--prefill-nodes", "1", "--decode-nodes", "1"),
    "disagg-remote": ("--policy", "disagg-remote", "--prefill-nodes", "1", "--decode-nodes", "1"),
    "colocated": ("--policy", "session-colocated", "--engines", "2"),
}
ROUTES = "kvpath_router_session_routes_total"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ampd", help="AMPD vs always-remote vs colocated: SLO attainment per trace")
    p.add_argument("--model", default="tiny")
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--sessions", type=int, default=10, help="sessions per trace")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson session arrivals per second")
    p.add_argument("--length-scale", type=float, default=0.15, help="scale of the Table 1 lengths (CPU)")
    p.add_argument("--max-context", type=int, default=2500, help="end a session before it outgrows this")
    p.add_argument("--max-turns", type=int, default=6, help="rounds per session at most")
    p.add_argument("--tool-scale", type=float, default=0.5, help="scale of the tool latencies between rounds")
    p.add_argument("--ttft-slo-ms", type=float, default=600.0)
    p.add_argument("--itl-slo-ms", type=float, default=60.0)
    p.add_argument("--profile", default="auto", help="cost profile file; auto: run `kvpath profile` first")
    p.add_argument("--sim", action="store_true", help="also the paper-scale simulator (sim_attainment)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--png", default="", help="plot of SLO attainment per trace and policy (empty: none)")
    p.add_argument("--work-dir", default="", help="keep traces, logs and per-run results here")
    p.set_defaults(func=_main)


@dataclass(slots=True)
class TraceRun:
    trace: str
    policy: str
    sessions: int
    requests: int
    failed: int
    attainment: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    local_share: float | None


def session_attainment(requests: list[dict[str, Any]], ttft_slo_s: float, itl_slo_s: float) -> float:
    """Share of sessions meeting the SLO as `services/policy/ampd_slo.py` defines it (the simulator's too):
    every round succeeded with TTFT <= the SLO and the session's mean ITL (over all its tokens after each
    round's first) is <= the SLO."""
    by_session: dict[str, list[RoundLatency]] = {}
    for r in requests:
        ttft = r["ttft_s"] if r["error"] is None else None
        decode_s = (r["t_last_token_s"] or r["t_first_s"] or 0.0) - (r["t_first_s"] or 0.0)
        latency = RoundLatency(ttft, decode_s, max(0, r["output_tokens"] - 1))
        by_session.setdefault(r["session_id"], []).append(latency)
    return attainment(by_session.values(), SessionSlo(ttft_slo_s, itl_slo_s))


def _main(args: argparse.Namespace) -> int:
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted((set(traces) - set(TRACES)) | (set(policies) - POLICIES.keys()))
    if unknown:
        raise SystemExit(f"kvpath bench ampd: unknown {unknown}; traces {TRACES}, policies {list(POLICIES)}")
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.work_dir) if args.work_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        work.mkdir(parents=True, exist_ok=True)
        profile = _profile(args, work)
        paths = {t: _synthesize(args, t, work / f"{t}.jsonl") for t in traces}
        runs = [r for p in policies for r in asyncio.run(_policy(p, args, paths, profile, work / p))]
    out: dict[str, Any] = {
        "attainment": _table(runs, "attainment"),
        "local_share": _table(runs, "local_share"),
    }
    if args.sim:
        out |= _sim(traces, args.seed)
    _print(runs, out)
    if args.json:
        out |= {
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "runs": [asdict(r) for r in runs],
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.png:
        plot(out, args.png)
    return 0


SIM_POLICIES = ("ampd", "disagg-remote", "colocated")


def _sim(traces: list[str], seed: int) -> dict[str, Any]:
    """The paper-scale simulator under the paper's protocol (AMPD on its planner's deployment, the baselines
    on their best; `loadgen/sim/ampd/protocol.py`): attainment averaged over Fig. 4's five rates, and at 2
    req/s the Fig. 5 ablation (on AMPD's deployment; DuReader and GAIA) and the Fig. 6 sweep (DuReader), each
    where its trace was asked for."""
    from loadgen.sim.ampd import paper_attainment, sensitivity
    from loadgen.sim.ampd.paper import ANCHOR_RATE
    from loadgen.sim.ampd.protocol import paper_deployment

    def ablation_deploy(trace: str, _policy: str) -> Deployment:
        return paper_deployment(trace, "ampd")

    ablation = ("disagg-remote", "ampd-no-reorder", "ampd-no-routing", "ampd")
    out: dict[str, Any] = {
        "sim_attainment": paper_attainment(traces, seed=seed, deploy=paper_deployment),
        "sim_deployments": {t: {p: asdict(paper_deployment(t, p)) for p in SIM_POLICIES} for t in traces},
    }
    fig5: list[str] = [t for t in ("dureader", "gaia") if t in traces]
    if fig5:
        out["sim_ablation"] = paper_attainment(
            fig5, policies=ablation, seed=seed, rates=(ANCHOR_RATE,), deploy=ablation_deploy
        )
    if "dureader" in traces:
        deployment = ablation_deploy("dureader", "ampd")
        out["sim_sensitivity"] = sensitivity("dureader", seed=seed, deployment=deployment)
    return out


def _profile(args: argparse.Namespace, work: Path) -> str:
    if args.profile != "auto":
        return str(args.profile)
    from gpu.runner import ModelRunner
    from loadgen.profiler import profile

    runner = ModelRunner.load(args.model, device="cpu", num_kv_blocks=80)
    try:
        model = profile(runner, repeats=2, max_tokens=1024, link="shm")
    finally:
        runner.close()
    path = work / "profile.json"
    path.write_text(json.dumps(model.to_dict(), indent=2))
    return str(path)


def _synthesize(args: argparse.Namespace, trace: str, path: Path) -> Path:
    opts = SynthOptions(
        agents=args.sessions,
        seed=args.seed,
        length_scale=args.length_scale,
        max_context=args.max_context,
        tool_scale=args.tool_scale,
    )
    kvpath.dump(path, synthesize(PROFILES[trace], opts))
    return path


async def _policy(
    policy: str, args: argparse.Namespace, paths: dict[str, Path], profile: str, work: Path
) -> list[TraceRun]:
    """One cluster for the policy, every trace replayed on it in turn (content salted per trace)."""
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    flags = [*POLICIES[policy], "--model", args.model]
    flags += [f"--router-arg=--cost-profile={profile}", f"--engine-arg=--cost-profile={profile}"]
    up = await asyncio.to_thread(UpProcess, work, *flags)
    runs = []
    try:
        async with aiohttp.ClientSession() as http:
            for i, (trace, path) in enumerate(paths.items()):
                before = await scrape(http, up.url)
                result = await run_replay(
                    _replay_config(args, up.url, path, work / trace, i), load_trace(str(path))
                )
                after = await scrape(http, up.url)
                runs.append(_trace_run(trace, policy, args, result, _local_share(before, after)))
    finally:
        await asyncio.to_thread(up.stop)
    return runs


def _replay_config(args: argparse.Namespace, url: str, path: Path, out: Path, salt: int) -> ReplayConfig:
    config = ReplayConfig(
        url=url,
        trace=str(path),
        mode="online",
        arrivals="poisson",
        rate=args.rate,
        seed=args.seed,
        history="output",
        max_turns=args.max_turns,
        vocab_size=250,
        min_token_id=3,
        content_salt=args.seed * 1000 + salt,
        extra_body=json.dumps({"ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms}),
        stop_when_steady=False,
        out=str(out.with_suffix(".json")),
        progress="off",
        label=out.name,
    )
    config.validate()
    return config


def _local_share(before: dict[Any, float], after: dict[Any, float]) -> float | None:
    counts = {"local": 0.0, "remote": 0.0}
    for (name, labels), value in after.items():
        if name == ROUTES:
            counts[dict(labels)["route"]] += value - before.get((name, labels), 0.0)
    total = counts["local"] + counts["remote"]
    return counts["local"] / total if total else None


def _trace_run(
    trace: str, policy: str, args: argparse.Namespace, result: dict[str, Any], local: float | None
) -> TraceRun:
    requests = result["requests"]
    ok = [r for r in requests if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itls = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    return TraceRun(
        trace=trace,
        policy=policy,
        sessions=len({r["session_id"] for r in requests}),
        requests=len(requests),
        failed=len(requests) - len(ok),
        attainment=session_attainment(requests, args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000),
        ttft_p50_s=_pct(ttfts, 50),
        ttft_p90_s=_pct(ttfts, 90),
        itl_p50_s=_pct(itls, 50),
        itl_p90_s=_pct(itls, 90),
        local_share=local,
    )


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _table(runs: list[TraceRun], field: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        out.setdefault(r.trace, {})[r.policy] = getattr(r, field)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def _print(runs: list[TraceRun], out: dict[str, Any]) -> None:
    head = ("trace", "policy", "SLO att.", "TTFT p50/p90 ms", "ITL p50/p90 ms", "local", "failed")
    print(f"{head[0]:<10} {head[1]:<14} {head[2]:>8} {head[3]:>16} {head[4]:>15} {head[5]:>6} {head[6]}")
    for r in runs:
        local = "-" if r.local_share is None else f"{r.local_share:.0%}"
        ttft = f"{_ms(r.ttft_p50_s)}/{_ms(r.ttft_p90_s)}"
        itl = f"{_ms(r.itl_p50_s)}/{_ms(r.itl_p90_s)}"
        print(
            f"{r.trace:<10} {r.policy:<14} {r.attainment:>8.0%} {ttft:>16} {itl:>15} {local:>6} "
            f"{r.failed}/{r.requests}"
        )
    for key in ("sim_attainment", "sim_ablation", "sim_sensitivity"):
        for name, row in out.get(key, {}).items():
            print(f"{key} {name:<10} " + "  ".join(f"{p} {v:.0%}" for p, v in row.items()))


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [(k, out[k]) for k in ("attainment", "sim_attainment") if k in out]
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 3.5), squeeze=False)
    for ax, (name, table) in zip(axes[0], tables, strict=True):
        traces = list(table)
        policies = sorted({p for row in table.values() for p in row})
        for j, policy in enumerate(policies):
            xs = np.arange(len(traces)) + j * 0.8 / len(policies)
            ax.bar(xs, [table[t].get(policy, 0.0) for t in traces], 0.8 / len(policies), label=policy)
        ax.set_xticks(np.arange(len(traces)) + 0.4 - 0.4 / len(policies), traces)
        ax.set_ylabel("SLO attainment")
        ax.set_title("live (this machine)" if name == "attainment" else "simulated, 4 x 8 GPUs")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

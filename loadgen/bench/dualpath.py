"""`kvpath bench dualpath`: the shape of DualPath's Figure 8 at toy scale, side by side in one run.

Every configuration is a real `kvpath up` cluster (nats-server, index, one storage service per emulated node
with the same storage bandwidth budget, prefill and decode engines, router) replaying the same synthetic
agentic trace offline (every agent starts at t=0, closed loop; JCT = time until the last agent is done).
The storage budget is set so that reading hit KV is the bottleneck, as in the paper. Reported:
  jct_speedup                    Basic 1P1D JCT / DualPath 1P1D JCT          (paper: up to 1.78x for 1P1D)
  dualpath_1p1d_over_basic_2p1d  DualPath 1P1D JCT / Basic 2P1D JCT          (paper: about equal)
  storage_balance                max/avg storage read traffic per window, DualPath 2P1D (paper: 1.18)
  storage_balance_rr             the same under round robin (dualpath-rr)    (paper: 1.53)
plus, per run, TTFT and its breakdown (schedule, allocate, read, queue, prefill) and the hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.balance import storage_balance
from loadgen.bench.scrape import scrape, stage_totals
from loadgen.config import ReplayConfig
from loadgen.formats import kvpath, load_trace
from loadgen.profiles import PROFILES, SynthOptions, synthesize
from loadgen.runner import run_replay
from services.up.process import UpProcess
from services.up.topology import fcfs_engine_args

RUNS: dict[str, tuple[str, int, int]] = {  # name -> (policy, prefill nodes, decode nodes)
    "basic-1p1d": ("basic", 1, 1),
    "dualpath-1p1d": ("dualpath", 1, 1),
    "basic-2p1d": ("basic", 2, 1),
    "dualpath-2p1d": ("dualpath", 2, 1),
    "dualpath-rr-2p1d": ("dualpath-rr", 2, 1),
}
STAGES = ("schedule", "allocate", "read", "queue", "prefill")
SAMPLE_PERIOD_S = 0.25


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "dualpath", help="DualPath vs Basic vs round robin when storage is the bottleneck"
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--agents", type=int, default=12, help="agents, all starting at t=0")
    p.add_argument("--turns", type=int, default=6, help="turns per agent")
    p.add_argument("--first-round-tokens", type=int, default=1536, help="each agent's random first round")
    p.add_argument(
        "--length-scale", type=float, default=0.125, help="scale of the dualpath-32k trace lengths"
    )
    p.add_argument("--storage-bandwidth", type=float, default=6e6, help="bytes/s of every node's storage NIC")
    p.add_argument("--runs", default=",".join(RUNS), help=f"which runs, of {','.join(RUNS)}")
    p.add_argument("--window-s", type=float, default=1.0, help="window of the storage balance metric")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--png", default="dualpath-bench.png", help="plot (empty: none)")
    p.add_argument("--work-dir", default="", help="keep traces, logs and per-run results here")
    p.set_defaults(func=_main)


@dataclass(slots=True)
class RunResult:
    name: str
    policy: str
    prefill_nodes: int
    decode_nodes: int
    jct_s: float
    requests: int
    failed: int
    ttft_p50_s: float
    ttft_p99_s: float
    hit_rate: float
    stages_mean_s: dict[str, float]
    read_bytes_per_node: dict[int, float]
    balance: float | None
    samples: list[tuple[float, int, float]] = field(default_factory=list)


def _main(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names) - RUNS.keys())
    if unknown:
        raise SystemExit(f"kvpath bench dualpath: unknown runs {unknown}; known: {', '.join(RUNS)}")
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.work_dir) if args.work_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        work.mkdir(parents=True, exist_ok=True)
        trace = _synthesize(args, work / "trace.jsonl")
        results = [asyncio.run(_run(name, args, trace, work / name)) for name in names]
    summary = summarize(results)
    _print(results, summary)
    if args.json:
        out = {
            **summary,
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "runs": [{k: v for k, v in asdict(r).items() if k != "samples"} for r in results],
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.png:
        plot(results, args.png)
    return 0


def _synthesize(args: argparse.Namespace, path: Path) -> Path:
    trace = synthesize(
        PROFILES["dualpath-32k"],
        SynthOptions(
            agents=args.agents,
            seed=args.seed,
            length_scale=args.length_scale,
            max_context=6000,
            base_trajectories=args.agents,
            first_round_tokens=args.first_round_tokens,
        ),
    )
    kvpath.dump(path, trace)
    return path


async def _run(name: str, args: argparse.Namespace, trace_path: Path, work: Path) -> RunResult:
    policy, p, d = RUNS[name]
    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    up = await asyncio.to_thread(
        UpProcess,
        work,
        "--model",
        args.model,
        "--policy",
        policy,
        "--prefill-nodes",
        str(p),
        "--decode-nodes",
        str(d),
        "--storage-bandwidth",
        str(args.storage_bandwidth),
        *fcfs_engine_args(policy),  # the paper's FCFS scheduler, as the README's table was measured
    )
    try:
        storage = {int(n.split("-")[1]): url for n, url in up.services.items() if n.startswith("storage-")}
        config = ReplayConfig(
            url=up.url,
            trace=str(trace_path),
            mode="offline",
            history="output",
            max_turns=args.turns,
            vocab_size=250,
            min_token_id=3,
            content_salt=args.seed,
            out=str(work / "result.json"),
            progress="off",
            label=name,
        )
        config.validate()
        async with aiohttp.ClientSession() as http:
            samples: list[tuple[float, int, float]] = []
            sampler = asyncio.create_task(_sample(http, storage, samples))
            try:
                result = await run_replay(config, load_trace(str(trace_path)))
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            await _sample_once(http, storage, samples, time.monotonic())
            stages = await _stage_means(http, up.url)
    finally:
        await asyncio.to_thread(up.stop)
    return _result(name, policy, p, d, result, stages, samples, args.window_s, sorted(storage))


async def _sample(http: aiohttp.ClientSession, storage: dict[int, str], samples: list) -> None:
    while True:
        await _sample_once(http, storage, samples, time.monotonic())
        await asyncio.sleep(SAMPLE_PERIOD_S)


async def _sample_once(http: aiohttp.ClientSession, storage: dict[int, str], samples: list, t: float) -> None:
    for node, url in storage.items():
        value = (await scrape(http, url)).get(("kvpath_storage_read_bytes_total", ()), 0.0)
        samples.append((t, node, value))


async def _stage_means(http: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    totals = stage_totals(await scrape(http, router_url), STAGES)
    return {stage: total / count if count else 0.0 for stage, (total, count) in totals.items()}


def _result(
    name: str,
    policy: str,
    p: int,
    d: int,
    result: dict[str, Any],
    stages: dict[str, float],
    samples: list[tuple[float, int, float]],
    window_s: float,
    nodes: list[int],
) -> RunResult:
    summary = result["summary"]
    requests = summary["requests"]
    t0 = min((t for t, _, _ in samples), default=0.0)
    rebased = [(t - t0, node, value) for t, node, value in samples]
    report = storage_balance(rebased, window_s, nodes=nodes, min_load_fraction=0.25) if rebased else None
    final = {node: max((v for _, n, v in samples if n == node), default=0.0) for node in nodes}
    return RunResult(
        name=name,
        policy=policy,
        prefill_nodes=p,
        decode_nodes=d,
        jct_s=summary["jct"]["all_agents_s"],
        requests=requests["completed"],
        failed=requests["failed"],
        ttft_p50_s=summary["ttft_s"]["p50"],
        ttft_p99_s=summary["ttft_s"]["p99"],
        hit_rate=_hit_rate(summary),
        stages_mean_s=stages,
        read_bytes_per_node=final,
        balance=report.mean_ratio if report else None,
        samples=rebased,
    )


def _hit_rate(summary: dict[str, Any]) -> float:
    hit = summary.get("hit_rate", {})
    value = hit.get("from_turn_2", hit.get("overall", 0.0))
    return float(value or 0.0)


def summarize(results: list[RunResult]) -> dict[str, float | None]:
    by = {r.name: r for r in results}

    def ratio(a: str, b: str) -> float | None:
        return by[a].jct_s / by[b].jct_s if a in by and b in by and by[b].jct_s else None

    return {
        "jct_speedup": ratio("basic-1p1d", "dualpath-1p1d"),
        "dualpath_1p1d_over_basic_2p1d": ratio("dualpath-1p1d", "basic-2p1d"),
        "storage_balance": by["dualpath-2p1d"].balance if "dualpath-2p1d" in by else None,
        "storage_balance_rr": by["dualpath-rr-2p1d"].balance if "dualpath-rr-2p1d" in by else None,
    }


def _print(results: list[RunResult], summary: dict[str, float | None]) -> None:
    head = f"{'run':<18}{'JCT s':>8}{'req':>6}{'fail':>5}{'TTFT p50':>10}{'p99':>8}{'hit':>7}{'balance':>9}  "
    print(head + "TTFT stages mean s (" + " / ".join(STAGES) + ")")
    for r in results:
        stages = " / ".join(f"{r.stages_mean_s[s]:.3f}" for s in STAGES)
        balance = f"{r.balance:.2f}" if r.balance is not None else "-"
        print(
            f"{r.name:<18}{r.jct_s:>8.1f}{r.requests:>6}{r.failed:>5}{r.ttft_p50_s:>10.3f}{r.ttft_p99_s:>8.3f}"
            f"{r.hit_rate:>7.3f}{balance:>9}  {stages}"
        )
    for key, value in summary.items():
        print(f"{key:<32} {value:.3f}" if value is not None else f"{key:<32} -")


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    balance_runs = [r for r in results if r.prefill_nodes + r.decode_nodes >= 3]
    fig, axes = plt.subplots(1, 1 + len(balance_runs), figsize=(5 + 5 * len(balance_runs), 4))
    axes = list(axes) if len(balance_runs) else [axes]
    axes[0].bar([r.name for r in results], [r.jct_s for r in results], color="tab:blue")
    axes[0].set_ylabel("JCT (s)")
    axes[0].set_title("Offline JCT, same trace")
    axes[0].tick_params(axis="x", rotation=30)
    for ax, run in zip(axes[1:], balance_runs, strict=True):
        for node in sorted(run.read_bytes_per_node):
            points = [(t, v) for t, n, v in run.samples if n == node][:: max(1, round(1.0 / SAMPLE_PERIOD_S))]
            rates = [
                (t1, (v1 - v0) / (t1 - t0) / 1e6)
                for (t0, v0), (t1, v1) in itertools.pairwise(points)
                if t1 > t0
            ]  # MB/s over ~1 s steps
            ax.plot([t for t, _ in rates], [r for _, r in rates], label=f"node {node}")
        ax.set_title(f"{run.name}: storage reads (balance {run.balance or 0:.2f})")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("MB/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

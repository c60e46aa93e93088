"""`kvpath bench auto`: one cost model choosing among every KV path (`--policy auto`) against the fixed
policies, on the five workloads of issue 13, in one run.

  simulated   every policy on `dualpath`, `ampd`, `pool`, `fanin` and `mix` on one simulated cluster
              (`loadgen/sim/auto`, 4 GPUs on 2 nodes, H100-class profile: 4 colocated engines for `auto` and
              the colocated policies, 1 prefill + 1 decode engine per node for the P/D policies), and with
              `--paper-scale` on 8 nodes with 4x the sessions. Scores are lower-is-better: mean session JCT
              in seconds, 1 - SLO attainment for ampd.
  live        (`--live`) real `kvpath up` clusters, one per policy and run, per configuration
              (`auto_live.py`): colocated engines on the pool tier (`beluga` vs `auto`) and on the
              remote-store tier (`cache-aware` vs `auto`) under shared documents + short sessions (mean
              latency); prefill/decode nodes under multi-turn agents (`dualpath`, `ampd`, `auto`: mean
              session JCT); a move-the-query fan-in on colocated engines (`--move-query route`, `fetch`,
              and `--policy auto --move-query auto`: mean latency); auto's predicted vs measured TTFT
              from the router's own log of each decision.

`--json FILE` writes `results` {workload: {policy: score}}, `ttft_mdape` (the live one with `--live`, else the
simulator's), `sim_ttft_mdape`, the plans each policy chose, and the live and paper-scale sections (`live`:
`results` {config: {policy: score}}, `rows` {config: {policy: row}}, `ttft_mdape`; also `live_ttft_mdape`).
`--explain N` prints N of auto's decisions on the mixed workload: plan, predicted TTFT and harm, runner-up,
simulated TTFT.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from loadgen.bench.auto_live_options import CONFIG_NAMES, LiveOptions
from loadgen.sim.auto.cluster import ClusterShape
from loadgen.sim.auto.report import explain, format_comparison
from loadgen.sim.auto.run import compare, gpu_profiles, simulate
from loadgen.sim.auto.workloads import Scale, build
from services.policy.auto import Decision

LIVE_CONFIGS = ",".join(CONFIG_NAMES)
LIVE_SIZES = (  # flag, default, help: the sizes of the live runs (tests pass tiny ones)
    ("--live-repeats", 2, "runs per policy and configuration (ABBA)"),
    ("--pd-sessions", 6, "pd: agent sessions (4-6 turns each)"),
    ("--pd-clients", 3, "pd: closed-loop clients, each runs whole sessions"),
    ("--pd-first-tokens", 1500, "pd: tokens of a session's first context"),
    ("--fanin-agents", 12, "fanin: sub-agents on the pinned document"),
    ("--fanin-clients", 0, "fanin: sub-agents in flight (0: all at once)"),
    ("--fanin-doc-tokens", 1500, "fanin: tokens of the pinned document"),
)
PAPER_SCALE = Scale(
    agents=96,
    ampd_sessions=192,
    ampd_rate=32,
    pool_docs=96,
    pool_questions=640,
    pool_rate=12,
    fanin_agents=128,
)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("auto", help="--policy auto vs every fixed policy on five workloads (issue 13)")
    p.add_argument("--json", default="", metavar="FILE", help="write the results as JSON")
    p.add_argument(
        "--explain",
        type=int,
        nargs="?",
        const=12,
        default=0,
        metavar="N",
        help="print N sample decisions of auto (default 12)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paper-scale", action="store_true", help="also simulate 8 nodes and 4x the sessions")
    p.add_argument("--live", action="store_true", help="also run real clusters (the configs below)")
    p.add_argument("--live-requests", type=int, default=48, help="questions of the live pool/remote runs")
    p.add_argument(
        "--live-configs",
        "--live-tiers",
        default=LIVE_CONFIGS,
        help="live configurations: pool, remote (KV tiers), pd (agents on P/D nodes), fanin (move the query)",
    )
    for flag, default, text in LIVE_SIZES:
        p.add_argument(flag, type=int, default=default, help=text)
    p.set_defaults(func=_run)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    profiles = gpu_profiles()
    summary = compare(Scale(), ClusterShape(), profiles, seed=args.seed, progress=_progress)
    out: dict[str, Any] = {
        "results": summary["results"],
        "plans": summary["plans"],
        "sim_ttft_mdape": summary["ttft_mdape"],
        "sim_ttft_mdape_by_workload": summary["ttft_mdape_by_workload"],
        "ttft_mdape": summary["ttft_mdape"],
        "ttft_mdape_source": "simulator",
    }
    print(format_comparison(summary, "simulated, 2 nodes (4 GPUs; auto on the 4 colocated engines)"))
    if args.paper_scale:
        paper = compare(PAPER_SCALE, ClusterShape(nodes=8), profiles, seed=args.seed, progress=_progress)
        out["paper_scale"] = {"results": paper["results"], "ttft_mdape": paper["ttft_mdape"]}
        print(format_comparison(paper, "simulated at paper scale, 8 nodes (16 GPUs), 4x the sessions"))
    if args.explain:
        print(_explain(args.explain, args.seed))
    if args.live:
        from loadgen.bench.auto_live import format_live, run_live

        live = run_live(_live_options(args), progress=_progress)
        out["live"], out["live_ttft_mdape"] = live, live["ttft_mdape"]
        if live.get("ttft_mdape") is not None:
            out["ttft_mdape"], out["ttft_mdape_source"] = live["ttft_mdape"], "live"
        print(format_live(live))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0


def _live_options(args: argparse.Namespace) -> LiveOptions:
    from loadgen.bench.auto_live import CONFIGS

    configs = tuple(c for c in args.live_configs.split(",") if c)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"kvpath bench auto: unknown live configs {unknown} (of {', '.join(CONFIGS)})")
    return LiveOptions(
        questions=args.live_requests,
        seed=args.seed,
        configs=configs,
        repeats=args.live_repeats,
        pd_sessions=args.pd_sessions,
        pd_clients=args.pd_clients,
        pd_first_tokens=args.pd_first_tokens,
        fanin_agents=args.fanin_agents,
        fanin_clients=args.fanin_clients,
        fanin_doc_tokens=args.fanin_doc_tokens,
    )


def _explain(n: int, seed: int) -> str:
    """`n` of auto's decisions on the mixed workload, spread over the run."""
    explained: list[tuple[Decision, float]] = []
    simulate(build("mix", Scale(), seed), "auto", ClusterShape(), gpu_profiles(), seed, "mix", explained)
    step = max(1, len(explained) // n)
    lines = [f"auto's decisions on the mix (every {step}th of {len(explained)}):"]
    lines += [explain(d, ttft) for d, ttft in explained[::step][:n]]
    return "\n".join(lines)

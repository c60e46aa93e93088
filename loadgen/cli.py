"""`kvpath loadgen ...` (also `python -m loadgen ...`).

synth     --profile NAME --agents N --seed S --out FILE     synthesize a trajectory trace
profiles                                                    list the profiles and their published means
stats     FILE [--format F] [--json]                        trace statistics under the papers' conventions
replay    --url URL --trace FILE [--mode offline|online]    replay against an OpenAI-compatible server
compare   A.json B.json [--json]                            two results side by side, with ratios B/A
plot      RESULT.json [...] --out-dir DIR                   PNG plots (several results overlay)
sim       --model M --config xPyD --policy P [--sweep S]    cluster simulator (loadgen/sim/cli.py)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from shared.config import add_config_args, config_from_args
from shared.errors import KvpathError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("loadgen", help="agentic trace synthesis, replay and reports")
    sub = parser.add_subparsers(dest="loadgen_command", required=True, metavar="SUBCOMMAND")
    _add_synth(sub)
    profiles = sub.add_parser("profiles", help="list the synthesis profiles")
    profiles.set_defaults(func=_guard(_profiles))
    _add_stats(sub)
    _add_replay(sub)
    compare = sub.add_parser("compare", help="two results side by side with ratios")
    compare.add_argument("a", help="baseline result JSON")
    compare.add_argument("b", help="result JSON to compare with the baseline")
    compare.add_argument("--section", default="summary", choices=("summary", "window"))
    compare.add_argument("--json", action="store_true", help="print the rows as JSON")
    compare.set_defaults(func=_guard(_compare))
    plot = sub.add_parser("plot", help="PNG plots of one or more results")
    plot.add_argument("results", nargs="+", help="result JSON files (overlaid)")
    plot.add_argument("--out-dir", required=True, help="directory for the PNG files")
    plot.set_defaults(func=_guard(_plot))
    from loadgen.sim.cli import register as register_sim

    register_sim(sub)
    from loadgen.profiler import register as register_profile

    register_profile(subparsers)  # `kvpath profile` (AMPD's cost model)
    from loadgen.sim.ampd.planner import register as register_plan

    register_plan(subparsers)  # `kvpath plan` (AMPD's deployment planner)


def _add_synth(sub: Any) -> None:
    from loadgen.profiles import PROFILES

    p = sub.add_parser("synth", help="synthesize a trajectory trace from a published workload profile")
    p.add_argument("--profile", required=True, choices=sorted(PROFILES))
    p.add_argument("--agents", type=int, required=True, help="number of agents (trajectories)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output JSONL path")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply every length (CPU runs)")
    p.add_argument("--max-context", type=int, default=0, help="end trajectories to fit this many tokens")
    p.add_argument(
        "--base-trajectories", type=int, default=0, help="agents replay this many base trajectories"
    )
    p.add_argument(
        "--first-round-tokens", type=int, default=64, help="random first round with base trajectories"
    )
    p.add_argument("--tool-scale", type=float, default=1.0, help="multiply tool latencies (0: none)")
    p.set_defaults(func=_guard(_synth))


def _add_stats(sub: Any) -> None:
    p = sub.add_parser("stats", help="trace statistics (papers' averaging conventions)")
    p.add_argument("file")
    p.add_argument("--format", default="auto", choices=("auto", "kvpath", "mooncake", "messages"))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--tokenizer", default="", help="tokenizer.json (or its directory) to count messages tokens"
    )
    p.add_argument("--default-output-tokens", type=int, default=256)
    p.set_defaults(func=_guard(_stats))


def _add_replay(sub: Any) -> None:
    from loadgen.config import ReplayConfig

    p = sub.add_parser("replay", help="replay a trace against an OpenAI-compatible server")
    p.add_argument("--config", default=None, help="YAML file (section `loadgen:`)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    add_config_args(p, ReplayConfig)
    p.set_defaults(func=_guard(_replay))


def _guard(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Known errors become one line on stderr and exit status 2, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except KvpathError as exc:
            print(f"kvpath loadgen: error: {exc.message}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"kvpath loadgen: error: {exc}", file=sys.stderr)
            return 2

    return run


def _synth(args: argparse.Namespace) -> int:
    from loadgen.formats import kvpath
    from loadgen.profiles import PROFILES, SynthOptions, synthesize

    opts = SynthOptions(
        agents=args.agents,
        seed=args.seed,
        length_scale=args.length_scale,
        max_context=args.max_context or None,
        base_trajectories=args.base_trajectories,
        first_round_tokens=args.first_round_tokens,
        tool_scale=args.tool_scale,
    )
    if args.length_scale <= 0 or args.tool_scale < 0 or args.base_trajectories < 0:
        raise ValueError("--length-scale must be > 0, --tool-scale and --base-trajectories >= 0")
    count = kvpath.dump(args.out, synthesize(PROFILES[args.profile], opts))
    print(f"wrote {count} agents of {args.profile} to {args.out}")
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from loadgen.profiles import PROFILES

    for p in PROFILES.values():
        means = ", ".join(f"{k}={v:g}" for k, v in p.published.items())
        print(f"{p.name:<14} {p.source}: {means}; tool latency mean {p.tool_mean_s:g} s")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from loadgen.formats import load_trace
    from loadgen.stats import trace_stats

    trace = load_trace(args.file, args.format)
    stats = trace_stats(
        trace, count_tokens=_tokenizer(args.tokenizer), default_output_tokens=args.default_output_tokens
    )
    header = stats.get("header") or {}
    published = header.get("published") or {}
    as_published = header.get("length_scale", 1.0) == 1.0 and not header.get("max_context")
    if published and as_published and not header.get("base_trajectories"):
        stats["published_error"] = {k: stats[k] / v - 1 for k, v in published.items() if k in stats}
    if args.json:
        print(orjson.dumps(stats, option=orjson.OPT_INDENT_2).decode())
        return 0
    for key, value in stats.items():
        if isinstance(value, float):
            value = f"{value:.6g}"
        print(f"{key:<18} {value}")
    return 0


def _tokenizer(path: str) -> Callable[[str], int] | None:
    if not path:
        return None
    from pathlib import Path

    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    tok = Tokenizer.from_file(str(file))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _replay(args: argparse.Namespace) -> int:
    from loadgen.config import ReplayConfig
    from loadgen.formats import load_trace
    from loadgen.runner import run_replay, summary_lines

    # shared.config binds its type variable to BaseConfig; ReplayConfig has its shape without the bus fields
    config = config_from_args(ReplayConfig, args, section="loadgen")  # type: ignore[type-var]
    trace = load_trace(config.trace, config.format)
    result = asyncio.run(run_replay(config, trace))
    if args.json:
        print(orjson.dumps({"meta": result["meta"], "summary": result["summary"]}).decode())
    else:
        print("\n".join(summary_lines(result)))
        print(f"result: {config.out}" + (f"; plots: {config.plot_dir}" if config.plot_dir else ""))
    if result["meta"]["interrupted"]:
        return 130
    failed = [r for r in result["requests"] if r.get("error") and r.get("error_code") != "cancelled"]
    if failed:  # a run whose requests failed did not measure what it set out to: say why, exit non-zero
        first = failed[0]
        print(
            f"kvpath loadgen: {len(failed)} requests failed; the first ({first['session_id']} turn "
            f"{first['turn']}): {first.get('error_code')}: {first['error']}",
            file=sys.stderr,
        )
        return 1
    return 0


def _compare(args: argparse.Namespace) -> int:
    from loadgen.report import compare_rows, format_compare
    from loadgen.result import load_result

    a, b = load_result(args.a), load_result(args.b)
    if args.json:
        print(orjson.dumps(compare_rows(a, b, args.section), option=orjson.OPT_INDENT_2).decode())
    else:
        print(format_compare(a, b, args.section))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from loadgen.report import plot_results
    from loadgen.result import load_result

    for path in plot_results([load_result(p) for p in args.results], args.out_dir):
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpath")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["loadgen", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `... | head`
        sys.stderr.close()
        return 0

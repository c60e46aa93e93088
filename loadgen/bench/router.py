"""`kvpath bench router`: the router and the bus alone.

nats-server, a real `kvpath serve router` and E load-driver processes posing as engines (`load_driver.py`:
one TokenBatch per step, no model; the processes are `stack.py`'s), with the client (`kvpath bench serve`,
`serve.py`: many concurrent SSE streams) in a process of its own. Reports the streamed tokens/s through the
router and every process's CPU% over the client's window.

The router's CPU budget: by default the OS schedules every process on every core; `--pin` gives the router
CPU 0 alone and puts nats-server, the load drivers and the client on the other CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadgen.bench.serve import ServeBenchConfig, run_async, run_serve_bench
from loadgen.bench.stack import (
    BenchStack,
    CpuSampler,
    RouterBenchOptions,
    listen_overflows,
    pin_cpus,
    start_py_spy,
    stop_py_spy,
)
from shared.errors import ServiceUnavailableError
from shared.logs import setup_logging

TARGET_TOKENS_PER_S = 20_000


def register(subparsers: Any) -> None:
    r = subparsers.add_parser("router", help="router + bus alone: streamed tokens/s through one router")
    r.add_argument("--streams", type=int, default=256, help="concurrent SSE streams")
    r.add_argument("--tokens-per-stream", type=int, default=500, help="output tokens per request")
    r.add_argument("--rounds", type=int, default=1, help="requests per stream slot (back to back)")
    r.add_argument("--engines", type=int, default=2, help="load-driver processes posing as engines")
    r.add_argument("--step-hz", type=float, default=100.0, help="steps per second of each load driver")
    r.add_argument("--prompt-tokens", type=int, default=32, help="prompt token ids per request")
    r.add_argument("--pin", action="store_true", help="router on CPU 0 alone, the rest on the other CPUs")
    r.add_argument("--router-arg", action="append", default=[], help="extra router flag (repeat)")
    r.add_argument(
        "--py-spy", default="", help="profile the router during the run into this file (.svg/.txt)"
    )
    r.add_argument("--router-src", default="", help="run the router from this source tree (A/B runs)")
    r.add_argument("--keep-logs", default="", help="copy the service logs to this directory")
    r.add_argument("--json", default="", help="also write the results to this file")
    r.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    setup_logging("bench-router", level="ERROR")  # results go to stdout; service logs stay in their files
    opts = RouterBenchOptions(
        streams=args.streams,
        tokens_per_stream=args.tokens_per_stream,
        rounds=args.rounds,
        engines=args.engines,
        step_hz=args.step_hz,
        prompt_tokens=args.prompt_tokens,
        pin=args.pin,
        router_args=[part for flag in args.router_arg for part in flag.split()],
        keep_logs=args.keep_logs,
        py_spy=args.py_spy,
        router_src=args.router_src,
    )
    try:
        opts.validate()
        out = run_async(run_router_bench(opts))
    except (ServiceUnavailableError, RuntimeError, TimeoutError, ValueError) as exc:
        print(f"kvpath bench router: {exc}", file=sys.stderr)
        return 1
    print(format_router_summary(out), flush=True)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0 if out["client"]["num_failed"] == 0 else 1


async def run_router_bench(opts: RouterBenchOptions) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="kvpath-bench-router-")
    stack = BenchStack(tmp, opts)
    try:
        await asyncio.to_thread(stack.start)
        await stack.wait_ready()
        warm = await run_serve_bench(
            ServeBenchConfig(url=stack.url, num_requests=2, prompt_tokens=8, max_tokens=4)
        )
        if warm["num_failed"]:
            raise RuntimeError(f"warm-up request failed: {warm['first_error']}")
        return await _measure(stack, opts, Path(tmp) / "client.json")
    finally:
        await asyncio.to_thread(stack.stop)
        shutil.rmtree(tmp, ignore_errors=True)


async def _measure(stack: BenchStack, opts: RouterBenchOptions, json_path: Path) -> dict[str, Any]:
    pids = stack.pids()
    cpu_split = pin_cpus(pids, opts.pin)
    sampler = CpuSampler(pids)
    sampling = asyncio.create_task(sampler.run())
    profiler = await start_py_spy(opts.py_spy, pids["router"][0]) if opts.py_spy else None
    overflows_before = listen_overflows()
    try:
        client = await _run_client(stack.url, opts, json_path, sampler)
        overflows = listen_overflows() - overflows_before if overflows_before >= 0 else -1
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        if profiler is not None:
            await stop_py_spy(profiler)
    sampler.sample()
    steps = await _engine_steps(stack.engine_urls)
    return {
        "streams": opts.streams,
        "tokens_per_stream": opts.tokens_per_stream,
        "rounds": opts.rounds,
        "engines": opts.engines,
        "step_hz": opts.step_hz,
        "cpu_split": cpu_split,
        "offered_tokens_per_s": opts.streams * opts.step_hz,
        "streamed_tokens_per_s": client["output_tokens_per_s"],
        "steady_tokens_per_s": client["steady_tokens_per_s"],
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "meets_target": client["steady_tokens_per_s"] >= TARGET_TOKENS_PER_S,
        **_cpu_fields(sampler, client),
        **steps,
        "listen_overflows": overflows,
        "client": client,
    }


def _cpu_fields(sampler: CpuSampler, client: dict[str, Any]) -> dict[str, Any]:
    """CPU% of every process over the client's whole run and over its steady window (all streams busy)."""
    t0, t1 = client["started_unix"], client["finished_unix"]
    cpu_s = sampler.seconds_between(t0, t1)
    out: dict[str, Any] = {
        "router_cpu_percent": 100 * cpu_s["router"] / (t1 - t0),
        "cpu_percent": {name: 100 * s / (t1 - t0) for name, s in cpu_s.items()},
        "tokens_per_router_cpu_s": client["output_tokens"] / cpu_s["router"] if cpu_s["router"] else 0.0,
        "steady_router_cpu_percent": 0.0,
        "steady_cpu_percent": {},
    }
    if client["steady_window_s"]:
        s0, s1 = (t0 + x for x in client["steady_window_s"])
        steady = sampler.seconds_between(s0, s1)
        out["steady_router_cpu_percent"] = 100 * steady["router"] / (s1 - s0)
        out["steady_cpu_percent"] = {name: 100 * s / (s1 - s0) for name, s in steady.items()}
    return out


async def _run_client(
    url: str, opts: RouterBenchOptions, json_path: Path, sampler: CpuSampler
) -> dict[str, Any]:
    """`kvpath bench serve` in a process of its own; its CPU joins the sampler as `client`."""
    args = [
        *("-m", "services.cli", "bench", "serve", "--url", url, "--quiet", "--json", str(json_path)),
        *("--concurrency", str(opts.streams), "--requests", str(opts.streams * opts.rounds)),
        *("--prompt-tokens", str(opts.prompt_tokens), "--max-tokens", str(opts.tokens_per_stream)),
    ]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    sampler.add("client", proc.pid)  # with --pin it inherits this process's CPUs
    budget_s = 120 + opts.rounds * opts.tokens_per_stream / opts.step_hz * 4
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), budget_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise TimeoutError(f"bench client did not finish within {budget_s:.0f}s") from None
    try:
        data = await asyncio.to_thread(json_path.read_bytes)
    except FileNotFoundError:
        tail = output.decode(errors="replace")[-3000:]
        raise RuntimeError(f"bench client failed (exit {proc.returncode}):\n{tail}") from None
    return dict(orjson.loads(data))


async def _engine_steps(urls: list[str]) -> dict[str, int]:
    """Steps the load drivers made and how many of them started late (a driver short of CPU)."""
    steps = late = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for url in urls:
            async with http.get(f"{url}/health") as resp:
                health = await resp.json()
            steps += int(health.get("num_steps", 0))
            late += int(health.get("num_late_steps", 0))
    return {"engine_steps": steps, "engine_late_steps": late}


def format_router_summary(out: dict[str, Any]) -> str:
    client = out["client"]
    verdict = "meets" if out["meets_target"] else "below"
    if out["offered_tokens_per_s"] < out["target_tokens_per_s"]:
        verdict = "offered load below"
    return "\n".join(
        [
            f"bench router: {out['streams']} streams x {out['tokens_per_stream']} tokens x {out['rounds']} "
            f"round(s), {out['engines']} load drivers at {out['step_hz']:.0f} steps/s "
            f"(offered {out['offered_tokens_per_s']:,.0f} tokens/s)",
            f"  cpu split               : {out['cpu_split']}",
            f"  streamed tokens/s       : {out['steady_tokens_per_s']:,.0f} while every stream was busy "
            f"({verdict} the {out['target_tokens_per_s']:,} target); {out['streamed_tokens_per_s']:,.0f} "
            "over the whole run",
            f"  router CPU              : {out['steady_router_cpu_percent']:.0f}% while all were busy; "
            f"{out['router_cpu_percent']:.0f}% over the run "
            f"({out['tokens_per_router_cpu_s']:,.0f} tokens per router CPU-second)",
            f"  CPU by process (steady) : {_percents(out['steady_cpu_percent'])}",
            f"  CPU by process (run)    : {_percents(out['cpu_percent'])}",
            f"  requests ok / failed    : {client['num_ok']} / {client['num_failed']}"
            + (f"  (first error: {client['first_error']})" if client["first_error"] else ""),
            f"  tokens per SSE chunk    : {client['tokens_per_chunk']:.2f}",
            f"  TTFT p50 / p99          : {client['ttft_ms']['p50']:.1f} / {client['ttft_ms']['p99']:.1f} ms",
            f"  ITL  p50 / p99          : {client['itl_ms']['p50']:.2f} / {client['itl_ms']['p99']:.2f} ms",
            f"  load-driver steps       : {out['engine_steps']} ({out['engine_late_steps']} late)",
            *_overflow_note(out["listen_overflows"]),
        ]
    )


def _overflow_note(overflows: int) -> list[str]:
    if overflows <= 0:
        return []
    return [
        f"  note: {overflows} connection attempts met a full listen queue during the run (host-wide count); "
        "each waits for a SYN retransmit (1 s, then 3 s), which shows up in TTFT p99"
    ]


def _percents(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {pct:.0f}%" for name, pct in cpu.items()) or "n/a"

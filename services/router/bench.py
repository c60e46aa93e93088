"""`kvpath bench serve` and `kvpath bench router`.

  bench serve   an OpenAI streaming client against any server (`bench_client.py`): tokens/s, req/s,
                TTFT, ITL and e2e percentiles.
  bench router  the router and the bus alone: nats-server, a real `kvpath serve router` and E load-driver
                processes posing as engines (`bench_engine.py`: one TokenBatch per step, no model), with the
                client (`bench serve`, many concurrent SSE streams) in a process of its own. Reports the
                streamed tokens/s through the router and every process's CPU% over the client's window.

The router's CPU budget: by default the OS schedules every process on every core; `--pin` gives the router
CPU 0 alone and puts nats-server, the load drivers and the client on the other CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from services.router.bench_client import ServeBenchConfig, format_summary, run_serve_bench
from shared.bus import Bus, Registry
from shared.errors import ServiceUnavailableError
from shared.logs import setup_logging
from shared.natsserver import NatsServer
from shared.protocol import ServiceInfo

TARGET_TOKENS_PER_S = 20_000


def register_bench(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI streaming client: tokens/s, TTFT, ITL (any server)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=64, help="requests in all")
    p.add_argument("--prompt-tokens", type=int, default=128, help="random prompt token ids per request")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, help="leading prompt tokens all share")
    p.add_argument("--token-id-range", type=int, nargs=2, default=(32, 127), metavar=("LO", "HI"))
    p.add_argument("--openai-only", action="store_true", help="no ignore_eos / return_token_ids extensions")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    p.set_defaults(func=run_serve)

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
    r.add_argument("--keep-logs", default="", help="copy the service logs to this directory")
    r.add_argument("--json", default="", help="also write the results to this file")
    r.set_defaults(func=run_router)


# ------------------------------------------------------------------------------------------ bench serve


def run_serve(args: argparse.Namespace) -> int:
    lo, hi = args.token_id_range
    cfg = ServeBenchConfig(
        url=args.url,
        model=args.model,
        concurrency=args.concurrency,
        num_requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        shared_prefix_tokens=args.shared_prefix_tokens,
        prompt_token_lo=lo,
        prompt_token_hi=hi,
        openai_only=args.openai_only,
        seed=args.seed,
    )
    try:
        out = _run_async(run_serve_bench(cfg))
    except (ValueError, aiohttp.ClientError, OSError) as exc:
        print(f"kvpath bench serve: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(format_summary(out), flush=True)
    if args.json:
        Path(args.json).write_bytes(
            orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
    return 0 if out["num_failed"] == 0 and out["num_ok"] > 0 else 1


def _run_async(coro: Any) -> Any:
    from shared.service import install_uvloop

    install_uvloop()
    return asyncio.run(coro)


# ----------------------------------------------------------------------------------------- bench router


@dataclass(slots=True)
class RouterBenchOptions:
    streams: int = 256
    tokens_per_stream: int = 500
    rounds: int = 1
    engines: int = 2
    step_hz: float = 100.0
    prompt_tokens: int = 32
    pin: bool = False
    router_args: list[str] = field(default_factory=list)
    keep_logs: str = ""
    py_spy: str = ""  # profile output file: .svg flamegraph, .txt collapsed stacks, .json speedscope
    startup_timeout_s: float = 90.0


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
    )
    try:
        out = _run_async(run_router_bench(opts))
    except (ServiceUnavailableError, RuntimeError, TimeoutError) as exc:
        print(f"kvpath bench router: {exc}", file=sys.stderr)
        return 1
    print(format_router_summary(out), flush=True)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0 if out["client"]["num_failed"] == 0 else 1


class BenchStack:
    """nats-server, one router process and the load drivers, in a temporary directory."""

    def __init__(self, tmp_dir: str, opts: RouterBenchOptions) -> None:
        self.tmp_dir = Path(tmp_dir)
        self.opts = opts
        self.log_dir = self.tmp_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.namespace = "bench" + uuid.uuid4().hex[:8]
        self.nats = NatsServer(store_dir=str(self.tmp_dir / "nats"), log_path=str(self.log_dir / "nats.log"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.url = ""
        self.engine_urls: list[str] = []

    def start(self) -> None:
        from gpu.model_spec import resolve_model

        resolve_model("tiny")  # the router loads its tokenizer
        (self.tmp_dir / "nats").mkdir(exist_ok=True)
        self.nats.start()
        router = ["-m", "services.cli", "serve", "router", "--http-port", "0", "--no-use-kv-cache"]
        self._spawn("router-0", [*router, *self.opts.router_args])
        for i in range(self.opts.engines):
            self._spawn(
                f"bench-engine-{i}",
                ["-m", "services.router.bench_engine", "--step-hz", str(self.opts.step_hz)],
            )

    def _spawn(self, service_id: str, args: list[str]) -> None:
        env = dict(
            os.environ,
            KVPATH_NATS_URL=self.nats.url,
            KVPATH_NAMESPACE=self.namespace,
            KVPATH_SERVICE_ID=service_id,
            PYTHONUNBUFFERED="1",
        )
        with open(self.log_dir / f"{service_id}.log", "ab") as out:
            self.procs[service_id] = subprocess.Popen(
                [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    async def wait_ready(self) -> None:
        """Every process registered as ready and the router seeing every load driver."""
        deadline = time.monotonic() + self.opts.startup_timeout_s
        bus = Bus(self.nats.url, self.namespace, name="bench-router")
        await bus.connect()
        registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
        try:
            await registry.open()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
                while True:
                    self._check_alive()
                    ready = {s.service_id: s for s in await registry.list() if s.status == "ready"}
                    if self.procs.keys() <= ready.keys():
                        url = ready["router-0"].http_url
                        async with http.get(f"{url}/health") as resp:
                            if resp.status == 200 and (await resp.json())["engines"] >= self.opts.engines:
                                self.url = url
                                self.engine_urls = [ready[k].http_url for k in self.procs if k != "router-0"]
                                return
                    if time.monotonic() > deadline:
                        raise ServiceUnavailableError(f"bench stack not ready in time (logs: {self.log_dir})")
                    await asyncio.sleep(0.1)
        finally:
            await bus.close()

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise ServiceUnavailableError(f"{name} exited with code {proc.returncode}:\n{tail}")

    def pids(self) -> dict[str, list[int]]:
        assert self.nats.proc is not None
        engines = [p.pid for k, p in self.procs.items() if k != "router-0"]
        return {"router": [self.procs["router-0"].pid], "engines": engines, "nats": [self.nats.proc.pid]}

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.nats.stop()
        if self.opts.keep_logs:
            shutil.copytree(self.log_dir, self.opts.keep_logs, dirs_exist_ok=True)


class CpuSampler:
    """CPU seconds (user + system) of groups of processes, sampled with wall-clock times (psutil)."""

    def __init__(self, groups: dict[str, list[int]], period_s: float = 0.1) -> None:
        self.groups = {name: [psutil.Process(pid) for pid in pids] for name, pids in groups.items()}
        self.period_s = period_s
        self.times_unix: list[float] = []
        self.cpu_s: dict[str, list[float]] = {name: [] for name in groups}
        self._last: dict[int, float] = {}

    def add(self, name: str, pid: int) -> None:
        self.groups[name] = [psutil.Process(pid)]
        self.cpu_s[name] = [0.0] * len(self.times_unix)

    def sample(self) -> None:
        self.times_unix.append(time.time())
        for name, procs in self.groups.items():
            self.cpu_s[name].append(sum(self._cpu_of(p) for p in procs))

    def _cpu_of(self, proc: psutil.Process) -> float:
        try:
            t = proc.cpu_times()
            self._last[proc.pid] = t.user + t.system
        except psutil.Error:
            pass  # exited: keep its last reading
        return self._last.get(proc.pid, 0.0)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    def seconds_between(self, t0_unix: float, t1_unix: float) -> dict[str, float]:
        """CPU seconds each group spent in [t0, t1] (linear between samples)."""
        import numpy as np

        times = np.asarray(self.times_unix)
        return {
            name: float(np.interp(t1_unix, times, values) - np.interp(t0_unix, times, values))
            for name, values in self.cpu_s.items()
        }


def _pin(pids: dict[str, list[int]], pin: bool) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return f"not pinned: every process may run on CPUs {cpus}"
    for name, group in pids.items():
        for pid in group:
            psutil.Process(pid).cpu_affinity([cpus[0]] if name == "router" else cpus[1:])
    os.sched_setaffinity(0, cpus[1:])
    return f"router on CPU {cpus[0]}; nats, load drivers, client and this process on CPUs {cpus[1:]}"


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
    cpu_split = _pin(pids, opts.pin)
    sampler = CpuSampler(pids)
    sampling = asyncio.create_task(sampler.run())
    profiler = await _start_py_spy(opts.py_spy, pids["router"][0]) if opts.py_spy else None
    try:
        client = await _run_client(stack.url, opts, json_path, sampler)
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        if profiler is not None:
            await _stop_py_spy(profiler)
    sampler.sample()
    cpu_s = sampler.seconds_between(client["started_unix"], client["finished_unix"])
    window_s = client["finished_unix"] - client["started_unix"]
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
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "meets_target": client["output_tokens_per_s"] >= TARGET_TOKENS_PER_S,
        "router_cpu_percent": 100 * cpu_s["router"] / window_s,
        "cpu_percent": {name: 100 * s / window_s for name, s in cpu_s.items()},
        "tokens_per_router_cpu_s": client["output_tokens"] / cpu_s["router"] if cpu_s["router"] else 0.0,
        **steps,
        "client": client,
    }


async def _start_py_spy(path: str, pid: int) -> asyncio.subprocess.Process:
    formats = {".svg": "flamegraph", ".txt": "raw", ".json": "speedscope"}
    fmt = formats.get(Path(path).suffix, "flamegraph")
    exe = Path(sys.executable).parent / "py-spy"
    return await asyncio.create_subprocess_exec(
        str(exe) if exe.exists() else "py-spy",
        *("record", "--pid", str(pid), "--rate", "200", "--format", fmt, "--output", path, "--nonblocking"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def _stop_py_spy(proc: asyncio.subprocess.Process) -> None:
    """py-spy writes its output on SIGINT."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()


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
    sampler.add("client", proc.pid)
    if opts.pin and len(os.sched_getaffinity(0)) >= 1:
        psutil.Process(proc.pid).cpu_affinity(sorted(os.sched_getaffinity(0)))
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
    cpu = ", ".join(f"{name} {pct:.0f}%" for name, pct in out["cpu_percent"].items())
    verdict = "meets" if out["meets_target"] else "below"
    return "\n".join(
        [
            f"bench router: {out['streams']} streams x {out['tokens_per_stream']} tokens x {out['rounds']} "
            f"round(s), {out['engines']} load drivers at {out['step_hz']:.0f} steps/s "
            f"(offered {out['offered_tokens_per_s']:,.0f} tokens/s)",
            f"  cpu split              : {out['cpu_split']}",
            f"  streamed tokens/s      : {out['streamed_tokens_per_s']:,.0f}  "
            f"({verdict} the {out['target_tokens_per_s']:,} target)",
            f"  router CPU             : {out['router_cpu_percent']:.0f}%  "
            f"({out['tokens_per_router_cpu_s']:,.0f} tokens per router CPU-second)",
            f"  CPU by process         : {cpu}",
            f"  requests ok / failed   : {client['num_ok']} / {client['num_failed']}"
            + (f"  (first error: {client['first_error']})" if client["first_error"] else ""),
            f"  tokens per SSE chunk   : {client['tokens_per_chunk']:.2f}",
            f"  TTFT p50 / p99         : {client['ttft_ms']['p50']:.1f} / {client['ttft_ms']['p99']:.1f} ms",
            f"  ITL  p50 / p99         : {client['itl_ms']['p50']:.2f} / {client['itl_ms']['p99']:.2f} ms",
            f"  load-driver steps      : {out['engine_steps']} ({out['engine_late_steps']} late)",
        ]
    )

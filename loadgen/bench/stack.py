"""Processes of `kvpath bench router`: nats-server, a real router, load drivers; CPU sampling; profiling."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from shared.bus import Bus, Registry
from shared.errors import ServiceUnavailableError
from shared.natsserver import NatsServer
from shared.protocol import ServiceInfo


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
    router_src: str = ""  # run the router from this source tree (A/B against another version)
    startup_timeout_s: float = 90.0

    def validate(self) -> None:
        if min(self.streams, self.tokens_per_stream, self.rounds, self.engines, self.prompt_tokens) < 1:
            raise ValueError("streams, tokens per stream, rounds, engines and prompt tokens must be >= 1")
        if self.step_hz <= 0:
            raise ValueError(f"step rate must be > 0, got {self.step_hz}")
        if self.router_src and not (Path(self.router_src) / "services" / "router").is_dir():
            raise ValueError(f"--router-src {self.router_src} holds no services/router")


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
        self._spawn("router-0", [*router, *self.opts.router_args], cwd=self.opts.router_src or None)
        for i in range(self.opts.engines):
            self._spawn(
                f"bench-engine-{i}",
                ["-m", "loadgen.bench.load_driver", "--step-hz", str(self.opts.step_hz)],
            )

    def _spawn(self, service_id: str, args: list[str], cwd: str | None = None) -> None:
        env = dict(
            os.environ,
            KVPATH_NATS_URL=self.nats.url,
            KVPATH_NAMESPACE=self.namespace,
            KVPATH_SERVICE_ID=service_id,
            PYTHONUNBUFFERED="1",
        )
        with open(self.log_dir / f"{service_id}.log", "ab") as out:
            self.procs[service_id] = subprocess.Popen(
                [sys.executable, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
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
        times = np.asarray(self.times_unix)
        return {
            name: float(np.interp(t1_unix, times, values) - np.interp(t0_unix, times, values))
            for name, values in self.cpu_s.items()
        }


def pin_cpus(pids: dict[str, list[int]], pin: bool) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return f"not pinned: every process may run on CPUs {cpus}"
    for name, group in pids.items():
        for pid in group:
            psutil.Process(pid).cpu_affinity([cpus[0]] if name == "router" else cpus[1:])
    os.sched_setaffinity(0, cpus[1:])
    return f"router on CPU {cpus[0]}; nats, load drivers, client and this process on CPUs {cpus[1:]}"


def listen_overflows() -> int:
    """Host-wide count of connections dropped because a listen queue was full (Linux; -1 elsewhere)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return -1
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            fields = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(fields.get("ListenOverflows", -1))
    return -1


async def start_py_spy(path: str, pid: int) -> asyncio.subprocess.Process:
    formats = {".svg": "flamegraph", ".txt": "raw", ".json": "speedscope"}
    fmt = formats.get(Path(path).suffix, "flamegraph")
    exe = Path(sys.executable).parent / "py-spy"
    try:
        return await asyncio.create_subprocess_exec(
            str(exe) if exe.exists() else "py-spy",
            *(
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--format",
                fmt,
                "--output",
                path,
                "--nonblocking",
            ),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise RuntimeError("py-spy is not installed (pip install py-spy)") from None


async def stop_py_spy(proc: asyncio.subprocess.Process) -> None:
    """py-spy writes its output on SIGINT."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()

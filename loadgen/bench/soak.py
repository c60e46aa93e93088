"""The soak of `kvpath bench faults`: multi-turn sessions against `kvpath up` while every service's RSS is
sampled (psutil), to show that memory stays bounded under sustained load.

Each session appends a few hundred tokens per turn to its growing context (most of it a cache hit) and starts
over past a few thousand tokens, as agents do. RSS counts the shared memory a process touched (the KV node
buffer, staging segments): it grows while those fill, so the verdict is on the last two-thirds of the run.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from loadgen.bench.fault_client import complete
from services.up.process import UpProcess

MAX_CONTEXT = 2500
SAMPLE_S = 2.0


@dataclass(slots=True)
class SoakResult:
    clients: int
    duration_s: float
    requests: int = 0
    failed: int = 0
    cached_share: float = 0.0
    # service -> (RSS MiB at start, at one third, at the end)
    rss_mib: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # service -> (t, MiB)

    @property
    def passed(self) -> bool:
        flat = all(third <= 0 or (end - third) / third < 0.10 for _, third, end in self.rss_mib.values())
        return flat and self.failed == 0


async def soak(work: Path, duration_s: float, clients: int) -> SoakResult:
    up = await asyncio.to_thread(_start, work)
    result = SoakResult(clients, duration_s)
    try:
        pids = {name: int(s["pid"]) for name, s in up.supervisor_state().items()}
        stop = time.monotonic() + duration_s
        counts = {"requests": 0, "failed": 0, "prompt": 0, "cached": 0}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            sampler = asyncio.ensure_future(_sample(pids, result, stop))
            await asyncio.gather(*(_session(http, up.url, i, stop, counts) for i in range(clients)))
            await sampler
        result.requests, result.failed = counts["requests"], counts["failed"]
        result.cached_share = counts["cached"] / max(1, counts["prompt"])
    finally:
        await asyncio.to_thread(up.stop)
    for name, series in result.samples.items():
        third = min(series, key=lambda s: abs(s[0] - duration_s / 3))[1]
        result.rss_mib[name] = (series[0][1], third, series[-1][1])
    return result


def _start(work: Path) -> UpProcess:
    work.mkdir(parents=True, exist_ok=True)
    return UpProcess(work, "--kv-root", str(work / "kv"))


async def _session(http: aiohttp.ClientSession, url: str, client: int, stop: float, counts: dict) -> None:
    rng = random.Random(client)
    context: list[int] = []
    while time.monotonic() < stop:
        if len(context) > MAX_CONTEXT:
            context = []
        context = context + [rng.randrange(3, 250) for _ in range(rng.randrange(150, 400))]
        end = await complete(http, url, context, max_tokens=24)
        counts["requests"] += 1
        counts["failed"] += end.outcome != "ok"
        counts["prompt"] += len(context)
        counts["cached"] += end.cached_tokens
        context = context + [rng.randrange(3, 250) for _ in range(end.tokens)]  # the answer, approximately


async def _sample(pids: dict[str, int], result: SoakResult, stop: float) -> None:
    procs = {}
    for name, pid in pids.items():
        try:
            procs[name] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
    started = time.monotonic()
    while True:
        now = time.monotonic()
        for name, proc in procs.items():
            try:
                mib = proc.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                continue
            result.samples.setdefault(name, []).append((now - started, mib))
        if now >= stop:
            return
        await asyncio.sleep(min(SAMPLE_S, max(0.0, stop - now)))

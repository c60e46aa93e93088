"""A burst of requests spreads over the colocated engines: requests picked while earlier ones wait for their
acks count those (they used to all land on the engine whose id sorts first)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from shared.bus import Bus
from tests.cluster import Stack, wait_ready

pytestmark = pytest.mark.slow


async def test_a_burst_is_spread_over_both_engines(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    s.start("router", "router-0", "--http-port", "0", "--no-use-kv-cache")
    for engine in ("engine-0", "engine-1"):
        s.start("engine", engine, "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0", "engine-1"}, s.procs, num_engines=2)
    body = {"model": "tiny", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def one(i: int) -> int:
            prompt = [(i * 37 + j) % 240 + 3 for j in range(100)]
            async with http.post(
                f"{ready['router-0'].http_url}/v1/completions", json={**body, "prompt": prompt}
            ) as r:
                return r.status

        assert await asyncio.gather(*(one(i) for i in range(8))) == [200] * 8
        finished = {}
        for engine in ("engine-0", "engine-1"):
            async with http.get(f"{ready[engine].http_url}/metrics") as resp:
                text = await resp.text()
            line = next(x for x in text.splitlines() if x.startswith("kvpath_engine_prefill_tokens_total"))
            finished[engine] = float(line.split()[-1])
    assert all(tokens >= 200 for tokens in finished.values()), finished  # each engine served 2+ requests

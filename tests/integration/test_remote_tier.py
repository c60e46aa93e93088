"""The remote-memory KV tier (`--kv-remote`, the RDMA-pool baseline) through the whole stack: a real store,
colocated engines on the tiny model, index, storage and router, over HTTP; KV bytes on the tcp data plane."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest

from shared.bus import Bus
from shared.hashing import block_hashes
from shared.kvclient import IndexClient
from tests.cluster import ServiceProcess, Stack, wait_ready
from tests.integration.test_kv_reuse import complete

pytestmark = pytest.mark.slow
BLOCK, CHUNK_TOKENS = 64, 256
ENGINE_ARGS = ("--kv-remote", "remotekv-0", "--no-persist-kv", "--kv-backends", "tcp")
ENGINE_ARGS += ("--remote-cache-bytes", str(64 << 20))


def cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def tokens(out: dict[str, Any]) -> list[int]:
    return list(out["choices"][0]["token_ids"])


async def engine_metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as resp:
        return await resp.text()


def counter(text: str, name: str, **labels: str) -> float:
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(wanted + " "))


async def until_engines(http: aiohttp.ClientSession, url: str, n: int, timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        async with http.get(f"{url}/health") as resp:
            if (await resp.json())["engines"] == n:
                return
        assert asyncio.get_running_loop().time() < deadline, f"the router never saw {n} engines"
        await asyncio.sleep(0.1)


async def test_remote_tier_hits_whole_super_blocks_across_engines_and_survives_the_store(
    stack: tuple[Stack, Bus], tmp_path: Any
) -> None:
    s, bus = stack
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    store = s.start("remotekv", "remotekv-0", "--capacity-bytes", str(64 << 20), "--kv-backends", "tcp")
    engine0 = s.start("engine", "engine-0", *ENGINE_ARGS)
    router = s.start("router", "router-0", "--http-port", "0")
    ids = {"index-0", "storage-0", "remotekv-0", "engine-0", "router-0"}
    ready = await wait_ready(bus, ids, s.procs)
    url = ready["router-0"].http_url
    rng = random.Random(5)
    prompt = [rng.randrange(3, 250) for _ in range(600)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        # engine 0: turn 1 computes and stores two super blocks; turn 2 hits them in its local cache
        first = await complete(http, url, prompt, 8, "a")
        second = await complete(http, url, prompt, 8, "a")
        assert (cached(first), cached(second)) == (0, 512)  # 9 usable blocks round down to 2 super blocks
        assert tokens(second) == tokens(first)
        fmt = ready["engine-0"].kv_format
        assert fmt is not None
        match = await IndexClient(bus).match(block_hashes(prompt, BLOCK, fmt.fingerprint))
        assert match.per_location.get("dram:engine-0") == 8  # the local cache, announced for routing
        text = await engine_metrics(http, ready["engine-0"].http_url)
        assert counter(text, "kvpath_engine_kv_remote_chunks_total", outcome="written") == 2
        assert counter(text, "kvpath_engine_kv_remote_chunks_total", outcome="local_hit") == 2

        # engine 1, alone, holds nothing locally: it hits through the store
        engine0.stop()
        await until_engines(http, url, 0)
        assert (
            await IndexClient(bus).match(block_hashes(prompt, BLOCK, fmt.fingerprint))
        ).num_hit_blocks == 0
        engine1 = s.start("engine", "engine-1", *ENGINE_ARGS)
        live: list[ServiceProcess] = [engine1, router, store]
        ready = await wait_ready(bus, {"engine-1", "router-0"}, live, num_engines=1)
        third = await complete(http, url, prompt, 8, "b")
        assert cached(third) == 512 and tokens(third) == tokens(first)
        text = await engine_metrics(http, ready["engine-1"].http_url)
        assert counter(text, "kvpath_engine_kv_remote_chunks_total", outcome="remote_hit") == 2
        assert counter(text, "kvpath_engine_kv_remote_bytes_total", direction="in") > 0

        # the store killed: local copies still hit, a new prompt misses and is not stored remotely
        store.kill()
        fourth = await complete(http, url, prompt, 8, "b")
        assert cached(fourth) == 512 and tokens(fourth) == tokens(first)
        other = [rng.randrange(3, 250) for _ in range(600)]
        cold = await complete(http, url, other, 8, "c")
        warm = await complete(http, url, other, 8, "c")  # the local cache kept what the store could not
        assert (cached(cold), cached(warm)) == (0, 512) and tokens(warm) == tokens(cold)
        text = await engine_metrics(http, ready["engine-1"].http_url)
        assert counter(text, "kvpath_engine_kv_remote_chunks_total", outcome="write_skipped") == 2
        assert 'kvpath_engine_kv_remote_errors_total{code="service_unavailable",op="put"}' in text

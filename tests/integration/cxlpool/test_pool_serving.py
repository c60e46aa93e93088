"""The Beluga pool tier through the whole stack: a real pool service, colocated engines mapping its memory,
index, storage and router, over HTTP. Greedy tokens loaded from the pool equal recompute; a killed pool makes
engines fall back to storage with identical tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shared.bus import Bus
from shared.hashing import block_hashes
from shared.kvclient import IndexClient
from tests.cluster import Stack, wait_ready
from tests.integration.test_kv_reuse import complete
from tests.integration.test_remote_tier import cached, counter, engine_metrics, tokens

pytestmark = pytest.mark.slow
BLOCK = 64


async def start_stack(s: Stack, bus: Bus, tmp_path: Path, model: str, *, engines: int = 2) -> dict[str, Any]:
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    s.start("cxlpool", "pool-0", "--model", model, "--capacity-bytes", str(32 << 20))
    ids = {"index-0", "storage-0", "pool-0", "router-0"}
    for i in range(engines):
        s.start("engine", f"engine-{i}", "--model", model, "--kv-pool", "pool-0")
        ids.add(f"engine-{i}")
    s.start("router", "router-0", "--http-port", "0", "--model", model, "--policy", "beluga")
    return await wait_ready(bus, ids, s.procs)


async def pool_hits(http: aiohttp.ClientSession, ready: dict[str, Any], engines: int) -> float:
    texts = [await engine_metrics(http, ready[f"engine-{i}"].http_url) for i in range(engines)]
    return sum(counter(t, "kvpath_engine_kv_pool_blocks_total", outcome="hit") for t in texts)


@pytest.mark.parametrize("model", ["tiny", "tiny-mla"])
async def test_greedy_tokens_from_the_pool_equal_recompute(
    stack: tuple[Stack, Bus], tmp_path: Path, model: str
) -> None:
    s, bus = stack
    ready = await start_stack(s, bus, tmp_path, model)
    url = ready["router-0"].http_url
    prompt = [random.Random(11).randrange(3, 250) for _ in range(450)]  # 7 full blocks, all may hit
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        first = await complete(http, url, prompt, 12, "p", model)
        again = [await complete(http, url, prompt, 12, "p", model) for _ in range(3)]
        assert cached(first) == 0
        for out in again:  # least-loaded routing spreads them: every engine reads the shared pool
            assert cached(out) == 448 and tokens(out) == tokens(first)
        assert await pool_hits(http, ready, 2) == 3 * 7
        fmt = ready["engine-0"].kv_format
        match = await IndexClient(bus).match(block_hashes(prompt, BLOCK, fmt.fingerprint)[:7])
        assert match.per_location.get("cxl:pool-0") == 7  # the pool's blocks are announced to the index


async def test_a_killed_pool_falls_back_to_storage_with_identical_tokens(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    s, bus = stack
    ready = await start_stack(s, bus, tmp_path, "tiny", engines=1)
    url = ready["router-0"].http_url
    pool = next(p for p in s.procs if p.service_id == "pool-0")
    prompt = [random.Random(12).randrange(3, 250) for _ in range(330)]  # 5 blocks hit
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        first = await complete(http, url, prompt, 10, "k")
        warm = await complete(http, url, prompt, 10, "k")
        assert cached(warm) == 320 and await pool_hits(http, ready, 1) == 5
        pool.kill()
        for _ in range(2):
            out = await complete(http, url, prompt, 10, "k")
            assert cached(out) == 320 and tokens(out) == tokens(first)  # from storage now
        text = await engine_metrics(http, ready["engine-0"].http_url)
        assert counter(text, "kvpath_engine_kv_pool_blocks_total", outcome="error") >= 5
        assert counter(text, "kvpath_engine_kv_loaded_blocks_total") >= 10
        fresh = [random.Random(13).randrange(3, 250) for _ in range(200)]  # new blocks: the pool write fails
        assert cached(await complete(http, url, fresh, 4, "k")) == 0
        assert cached(await complete(http, url, fresh, 4, "k")) == 192

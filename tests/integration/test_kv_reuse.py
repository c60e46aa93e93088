"""Multi-turn KV reuse through the whole stack: `kvpath up` with storage and index, over HTTP."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shared.bus import Bus
from tests.cluster import ServiceProcess, Stack, UpProcess, wait_ready
from tests.integration.test_ampd import metric
from tests.integration.test_api import wait_until

pytestmark = pytest.mark.slow
BLOCK = 64


@pytest.fixture(scope="module")
def kv_cluster(kv_store_cluster: UpProcess) -> UpProcess:
    """`kvpath up --kv-root DIR`, shared with the load generator's tests (tests/conftest.py)."""
    return kv_store_cluster


async def complete(
    http: aiohttp.ClientSession, url: str, prompt: list[int], n: int, session: str, model: str = "tiny"
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-Id": session}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def run_session(
    http: aiohttp.ClientSession, url: str, seed: int, model: str = "tiny"
) -> list[dict[str, Any]]:
    """Three turns: each prompt = previous prompt + previous output + a fresh append."""
    rng = random.Random(seed)
    appends = [[rng.randrange(3, 250) for _ in range(n)] for n in (300, 90, 75)]
    context: list[int] = []
    results = []
    for turn, append in enumerate(appends):
        prompt = context + append
        out = await complete(http, url, prompt, 37, f"s{seed}", model)
        assert out["prompt_token_ids"] == prompt
        results.append({"prompt": prompt, "out": out})
        context = prompt + out["choices"][0]["token_ids"]
        assert len(out["choices"][0]["token_ids"]) == 37, turn
    return results


async def test_three_turn_session_hits_and_matches_recompute(
    kv_cluster: UpProcess, cold_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    warm = await run_session(http, kv_cluster.url, seed=1)
    cold = await run_session(http, cold_cluster.url, seed=1)
    for turn in (1, 2):
        prev = warm[turn - 1]
        # the previous turn's context whose KV exists: its prompt and all output tokens but the last
        prev_context = len(prev["prompt"]) + len(prev["out"]["choices"][0]["token_ids"]) - 1
        cached = warm[turn]["out"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prev_context // BLOCK * BLOCK, (turn, cached, prev_context)
        assert cached % BLOCK == 0 and cached < len(warm[turn]["prompt"])
    assert warm[0]["out"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for w, c in zip(warm, cold, strict=True):
        assert w["out"]["choices"][0]["token_ids"] == c["out"]["choices"][0]["token_ids"]
    assert all(c["out"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for c in cold)


def corrupt_block_file(store: Path, prompt: list[int], block: int) -> None:
    """Flip the payload tail of one stored block (header intact): only its checksum can catch it."""
    from gpu.model_spec import load_model_spec
    from shared.hashing import block_hashes, fingerprint_seed

    fingerprint = load_model_spec("tiny").fingerprint("float32", BLOCK)
    name = f"{block_hashes(prompt, BLOCK, fingerprint)[block]:016x}"
    path = store / f"{fingerprint_seed(fingerprint):016x}" / name[:2] / name[2:4] / f"{name}.blk"
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 100)


async def test_corrupt_block_is_a_partial_miss_not_a_failure(
    kv_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 250) for _ in range(400)]
    first = await complete(http, kv_cluster.url, prompt, 5, "c")
    again = await complete(http, kv_cluster.url, prompt, 5, "c")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 384
    corrupt_block_file(kv_cluster.kv_root, prompt, block=3)
    third = await complete(http, kv_cluster.url, prompt, 5, "c")
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # blocks 0-2; 3 is bad
    assert third["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # the corrupt file was dropped and block 3 persisted again by the recompute
    fourth = await complete(http, kv_cluster.url, prompt, 5, "c")
    assert fourth["usage"]["prompt_tokens_details"]["cached_tokens"] == 384


async def test_storage_down_still_serves(stack: tuple[Stack, Bus], tmp_path: Path) -> None:
    s, bus = stack
    s.start("index", "index-0")
    storage = s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    s.start("engine", "engine-0")
    s.start("router", "router-0", "--http-port", "0")
    ready = await wait_ready(bus, {"index-0", "storage-0", "engine-0", "router-0"}, s.procs)
    url = ready["router-0"].http_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        prompt = list(range(3, 203))
        first = await complete(http, url, prompt, 4, "d")
        assert (await complete(http, url, prompt, 4, "d"))["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ] == 192
        storage.kill()
        again = await complete(http, url, prompt, 4, "d")
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        engine_url = ready["engine-0"].http_url
        misses = await metric(http, engine_url, "kvpath_engine_kv_load_misses_total", "service_unavailable")
        assert misses >= 1
        # its writes wait for a storage restart (RESTART_GRACE_S) up to their timeout, then fail
        persist = "kvpath_engine_kv_persist_failures_total"
        await wait_until(lambda: _is_positive(metric(http, engine_url, persist)), timeout_s=20)


async def _is_positive(value: Awaitable[float]) -> bool:
    return await value > 0


async def test_the_router_hashes_with_the_engines_kv_format(stack: tuple[Stack, Bus], tmp_path: Path) -> None:
    """The router has no dtype or block size of its own: bfloat16 engines get hits on turn 2, and an engine
    announcing another format is refused (listed in the router's health, never sent a request)."""
    s, bus = stack
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    s.start("engine", "engine-0", "--dtype", "bfloat16")
    s.start("router", "router-0", "--http-port", "0")
    ready = await wait_ready(bus, {"index-0", "storage-0", "engine-0", "router-0"}, s.procs)
    url = ready["router-0"].http_url
    assert (
        ready["engine-0"].kv_format is not None
        and "dtype=bfloat16" in ready["engine-0"].kv_format.fingerprint
    )
    other = s.start("engine", "engine-1", "--dtype", "float32")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        refused = await _until_refused(http, url, "engine-1", other)
        assert "dtype=float32" in refused and "dtype=bfloat16" in refused
        prompt = list(range(3, 203))
        await complete(http, url, prompt, 4, "f")
        for _ in range(3):
            again = await complete(http, url, prompt, 4, "f")
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
        async with http.get(f"{url}/health") as resp:
            assert (await resp.json())["engines"] == 1
        both = await wait_ready(bus, {"engine-0", "engine-1", "router-0"}, s.procs, num_engines=1)
        served = {e: await _finished_requests(http, both[e].http_url) for e in ("engine-0", "engine-1")}
    assert served == {"engine-0": 4.0, "engine-1": 0.0}


async def _finished_requests(http: aiohttp.ClientSession, engine_url: str) -> float:
    async with http.get(f"{engine_url}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvpath_engine_requests_finished_total{")
    )


async def _until_refused(http: aiohttp.ClientSession, url: str, engine_id: str, proc: ServiceProcess) -> str:
    """The router's reason for refusing `engine_id`, once its reports arrive (bounded wait)."""
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        async with http.get(f"{url}/health") as resp:
            refused = (await resp.json()).get("refused_engines", {})
        if engine_id in refused:
            return str(refused[engine_id])
        assert proc.proc.poll() is None, proc.log()
        assert asyncio.get_running_loop().time() < deadline, "the router never refused the engine"
        await asyncio.sleep(0.1)


async def test_index_outage_costs_no_latency_and_hits_return(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    """Persisting announces to the index without making requests wait on it: with the index killed,
    requests that write new blocks end as fast as ever (they used to wait PERSIST_WAIT_S each); the
    restarted index replays the events of the outage, so what was written meanwhile hits again."""
    from services.engine.persist import PERSIST_WAIT_S

    s, bus = stack
    index = s.start("index", "index-0")
    s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    s.start("engine", "engine-0")
    s.start("router", "router-0", "--http-port", "0")
    ready = await wait_ready(bus, {"index-0", "storage-0", "engine-0", "router-0"}, s.procs)
    url = ready["router-0"].http_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        await complete(http, url, list(range(3, 203)), 4, "w")  # warm: model, storage, index path
        index.kill()
        loop = asyncio.get_running_loop()
        durations = []
        for i in range(4):
            started = loop.time()
            out = await complete(http, url, [(i * 31 + j) % 240 + 3 for j in range(200)], 4, f"o{i}")
            durations.append(loop.time() - started)
            assert len(out["choices"][0]["token_ids"]) == 4
        assert max(durations) < PERSIST_WAIT_S / 2, durations
        s.start("index", "index-0")
        await wait_ready(bus, {"index-0"}, s.procs)
        outage_prompt = [(3 * 31 + j) % 240 + 3 for j in range(200)]
        deadline = loop.time() + 30
        cached = 0
        while cached != 192 and loop.time() < deadline:  # the replay of the outage's events
            out = await complete(http, url, outage_prompt, 4, "o3")
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 192

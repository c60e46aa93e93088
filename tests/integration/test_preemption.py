"""A full cache preempts running sequences; a colocated engine then reloads the prefix it stored meanwhile
instead of recomputing the prompt, and the tokens are those of each request served alone."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
BLOCK = 64
PROMPT_TOKENS = 330  # 5 whole blocks stored per prompt, and a partial one
MAX_TOKENS = 100  # 7 blocks per sequence at the end: four of them do not fit in 16 blocks at once


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """One colocated engine of 16 blocks, storage and index."""
    tmp: Path = tmp_path_factory.mktemp("preempt")
    up = UpProcess(tmp, "--kv-root", str(tmp / "store"), "--engine-arg=--num-kv-blocks 16")
    try:
        yield up
    finally:
        assert up.stop() == 0, up.log()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def greedy(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    return list(out["choices"][0]["token_ids"])


async def engine_counters(http: aiohttp.ClientSession, up: UpProcess) -> dict[str, float]:
    (url,) = (u for name, u in up.services.items() if name.startswith("engine"))
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = {"kvpath_engine_preemptions", "kvpath_engine_kv_loaded_blocks", "kvpath_engine_prefill_tokens"}
    return {
        f.name: sum(s.value for s in f.samples if s.name.endswith("_total"))
        for f in text_string_to_metric_families(text)
        if f.name in wanted
    }


async def test_preempted_sequences_reload_their_stored_prompt_and_keep_their_tokens(
    small_cache: UpProcess, cold_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(4)]
    before = await engine_counters(http, small_cache)
    together = await asyncio.gather(*(greedy(http, small_cache.url, p) for p in prompts))
    after = await engine_counters(http, small_cache)
    alone = [await greedy(http, cold_cluster.url, p) for p in prompts]
    assert together == alone
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    preemptions = delta["kvpath_engine_preemptions"]
    assert preemptions >= 1, delta
    # the preempted sequences read stored blocks back (there were none before: fresh prompts, no first hits)
    assert 1 <= delta["kvpath_engine_kv_loaded_blocks"] <= preemptions * (PROMPT_TOKENS // BLOCK), delta
    # and computed the prompts about once: recomputing a preempted prompt would add at least its stored blocks
    again = preemptions * (BLOCK + PROMPT_TOKENS % BLOCK + MAX_TOKENS)
    assert delta["kvpath_engine_prefill_tokens"] <= len(prompts) * PROMPT_TOKENS + again, delta

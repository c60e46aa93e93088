"""A decode engine whose DE buffer is full refuses a hand-off (nothing is reserved there); the router counts
it full until its next report and places the request again, so a burst larger than the buffer is served
whole instead of answered 429 (before: 24 of 150 concurrent SmolLM2 chats on a DualPath 1P1D cluster)."""

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
TINY_BLOCK_BYTES = 64 * 4 * 512  # 64 tokens x 4 layers x 512 B of fp32 K and V per token and layer
PROMPT_TOKENS = 330  # 6 blocks: the 8-block buffer holds one prompt at a time


@pytest.fixture(scope="module")
def small_buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp: Path = tmp_path_factory.mktemp("debuf")
    args = ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "dualpath", "--no-kv-store")
    up = UpProcess(tmp, *args, f"--engine-arg=--de-buffer-bytes {8 * TINY_BLOCK_BYTES}")
    try:
        yield up
    finally:
        assert up.stop() == 0, up.log()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def greedy(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with http.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}) as resp:
        assert resp.status == 200, await resp.text()
        return list((await resp.json())["choices"][0]["token_ids"])


async def refusals(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        if family.name == "kvpath_router_decode_refusals":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("kvpath_router_decode_refusals_total not exported")


async def test_a_burst_past_the_de_buffer_is_placed_again_not_refused(
    small_buffer: UpProcess, cold_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(6)]
    before = await refusals(http, small_buffer.url)
    together = await asyncio.gather(*(greedy(http, small_buffer.url, p) for p in prompts))
    assert await refusals(http, small_buffer.url) > before  # the buffer did turn requests away
    assert together == [await greedy(http, cold_cluster.url, p) for p in prompts]

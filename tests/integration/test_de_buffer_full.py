"""A decode engine whose DE buffer is full refuses a hand-off (nothing is reserved there). DualPath counts it
full until its next report and places the request again, the always-remote baseline waits in line for its
room (`room_queue.py`), AMPD prefills the turn on the decode engine itself, `auto` decides again among local
plans: a burst larger than the buffer is served whole instead of answered 429 (before: 24 of 150 concurrent
SmolLM2 chats on DualPath 1P1D, 32 of 100 under AMPD)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
TINY_BLOCK_BYTES = 64 * 4 * 512  # 64 tokens x 4 layers x 512 B of fp32 K and V per token and layer
PROMPT_TOKENS = 330  # 6 blocks: the 8-block buffer holds one prompt at a time


@pytest.fixture(scope="module", params=["dualpath", "ampd", "disagg-remote", "auto"])
def small_buffer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, UpProcess]]:
    """(policy, cluster): one prefill and one decode engine, the decode engine's buffer 8 blocks."""
    tmp: Path = tmp_path_factory.mktemp("debuf")
    args = ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", request.param, "--no-kv-store")
    up = UpProcess(tmp, *args, f"--engine-arg=--de-buffer-bytes {8 * TINY_BLOCK_BYTES}")
    try:
        yield request.param, up
    finally:
        assert up.stop() == 0, up.log()


async def greedy(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with http.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}) as resp:
        assert resp.status == 200, await resp.text()
        return list((await resp.json())["choices"][0]["token_ids"])


async def counter(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """The router's counter `name` (its samples with `labels`, summed)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == name:
            picked = (s for s in family.samples if s.name.endswith("_total"))
            total += sum(s.value for s in picked if labels.items() <= s.labels.items())
    return total


async def test_a_burst_past_the_de_buffer_is_placed_again_not_refused(
    small_buffer: tuple[str, UpProcess], cold_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    policy, cluster = small_buffer
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(6)]
    url, name = cluster.url, "kvpath_router_decode_refusals"
    before = await counter(http, url, name)
    local_before = await counter(http, url, "kvpath_router_session_routes", reason="remote_full")
    together = await asyncio.gather(*(greedy(http, url, p) for p in prompts))
    refused = await counter(http, url, name) - before
    assert refused > 0  # the buffer did turn requests away
    assert together == [await greedy(http, cold_cluster.url, p) for p in prompts]
    local = await counter(http, url, "kvpath_router_session_routes", reason="remote_full") - local_before
    if policy == "ampd":
        assert local == refused  # each refused turn ran on the decode engine
    else:
        assert local == 0  # placed again (the baselines stay what they are), or decided again (auto)

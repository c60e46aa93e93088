"""A prefill engine whose staging buffer (the KV it sends to decode engines) is full queues the next prefill
until room frees, first come first served, instead of refusing it: the session policies answered such a
refusal with a 429 (32 concurrent agent sessions of 6 SmolLM2 turns on always-remote 1P1D: 14 of 173
turns). Each cluster's PE staging holds one 6-block prompt at a time; six such prompts at once are all
served, with the tokens of a cluster that never queued."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.cluster import UpProcess
from tests.integration.test_de_buffer_full import TINY_BLOCK_BYTES, counter, greedy

pytestmark = pytest.mark.slow
PROMPT_TOKENS = 330  # 6 blocks of 64: an 8-block staging buffer holds one prompt at a time


@pytest.fixture(scope="module", params=["disagg-remote", "ampd", "dualpath"])
def small_staging(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpProcess]:
    tmp: Path = tmp_path_factory.mktemp("pestaging")
    args = ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", request.param, "--no-kv-store")
    up = UpProcess(tmp, *args, f"--engine-arg=--pe-staging-bytes {8 * TINY_BLOCK_BYTES}")
    try:
        yield up
    finally:
        assert up.stop() == 0, up.log()


async def test_a_burst_past_the_pe_staging_buffer_waits_for_room_and_is_served(
    small_staging: UpProcess, cold_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(6)]
    pe_url = next(u for name, u in small_staging.services.items() if name.startswith("pe"))
    before = await counter(http, pe_url, "kvpath_engine_staging_waits")
    together = await asyncio.gather(*(greedy(http, small_staging.url, p) for p in prompts))
    assert await counter(http, pe_url, "kvpath_engine_staging_waits") - before > 0  # some did wait
    assert together == [await greedy(http, cold_cluster.url, p) for p in prompts]

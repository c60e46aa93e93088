"""The engine's prefill order on real processes (nats-server, index, router, one colocated engine on the
tiny model, a 64-token step budget): while a 6,000-token prompt prefills, short prompts that arrive after
it get their first token before it does with `--prefill-order short-first`, and after it with first come,
first served (the control: the order, not the timing, decides)."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from shared.bus import Bus
from tests.cluster import Stack, wait_ready
from tests.integration.test_kv_reuse import complete
from tests.integration.test_movequery import stream_until_first_token
from tests.integration.test_remote_tier import counter, engine_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("order", ["fcfs", "short-first"])
async def test_short_prompts_pass_a_long_prefill_only_shortest_first(
    stack: tuple[Stack, Bus], order: str
) -> None:
    s, bus = stack
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 250) for _ in range(6000)]
    shorts = [[rng.randrange(3, 250) for _ in range(20)] for _ in range(3)]
    s.start("index", "index-0")
    args = ("--prefill-order", order, "--max-num-batched-tokens", "64", "--no-persist-kv", "--no-load-kv")
    s.start("engine", "engine-0", *args)
    s.start("router", "router-0", "--http-port", "0")
    ready = await wait_ready(bus, {"index-0", "engine-0", "router-0"}, s.procs)
    url, engine = ready["router-0"].http_url, ready["engine-0"].http_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        long_task, long_first = stream_until_first_token(http, url, long_prompt, 2)
        deadline = time.monotonic() + 60
        while counter(await engine_metrics(http, engine), "kvpath_engine_prefill_tokens_total") < 64:
            assert time.monotonic() < deadline and not long_first.is_set(), "the long prefill never started"
            await asyncio.sleep(0.01)
        done_before_long = []

        async def short(i: int, prompt: list[int]) -> None:
            await complete(http, url, prompt, 1, f"short{i}")
            done_before_long.append(not long_first.is_set())

        await asyncio.gather(*(short(i, p) for i, p in enumerate(shorts)))
        assert len(await long_task) == 2
    assert done_before_long == [order == "short-first"] * 3

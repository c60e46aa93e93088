"""The prefill order on real processes (nats-server, index, router, engines on the tiny model, a 64-token
step budget): while a 6,000-token prompt prefills, short prompts that arrive after it get their first token
before it does with `--prefill-order short-first`, and after it with first come, first served (the control:
the order, not the timing, decides). On one colocated engine, and on prefill/decode nodes, where DualPath's
router holds requests while the PE is over beta."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

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
    done_before_long = await shorts_after_long(url, engine, long_prompt, shorts)
    assert done_before_long == [order == "short-first"] * 3


@pytest.mark.parametrize("router_order", ["fcfs", "short-first"])
async def test_on_pd_nodes_short_prompts_pass_a_long_prefill_when_the_router_orders_shortest_first(
    stack: tuple[Stack, Bus], tmp_path: Path, router_order: str
) -> None:
    """DualPath on one PE and one DE. The PE orders its queue shortest first in both runs; with beta_s at
    0.02 the long prompt keeps it over beta. First come, first served, the short prompts wait in the
    router's placement queue until the long prefill is done; shortest first, the router sends them to the
    PE past beta (its report shows nothing shorter ahead of them), where they pass the long prompt."""
    s, bus = stack
    rng = random.Random(4)
    long_prompt = [rng.randrange(3, 250) for _ in range(6000)]
    shorts = [[rng.randrange(3, 250) for _ in range(20)] for _ in range(3)]
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--node", "0", "--root", str(tmp_path / "store"))
    s.start("engine", "de-0", "--role", "decode", "--node", "0")
    budget = ("--prefill-order", "short-first", "--max-num-batched-tokens", "64")
    s.start("engine", "pe-0", "--role", "prefill", "--node", "0", *budget)
    order = ("--prefill-order", router_order, "--beta-s", "0.02")
    s.start("router", "router-0", "--http-port", "0", "--policy", "dualpath", *order)
    ids = {"index-0", "storage-0", "de-0", "pe-0", "router-0"}
    ready = await wait_ready(bus, ids, s.procs, num_engines=2)
    url, pe = ready["router-0"].http_url, ready["pe-0"].http_url
    done_before_long = await shorts_after_long(url, pe, long_prompt, shorts)
    assert done_before_long == [router_order == "short-first"] * 3


async def shorts_after_long(
    url: str, engine: str, long_prompt: list[int], shorts: list[list[int]]
) -> list[bool]:
    """Stream the long prompt; once the engine at `engine` has prefilled 64 tokens of it, send the short
    prompts; for each, whether it finished before the long prompt's first token came."""
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
    return done_before_long

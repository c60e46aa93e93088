"""The Beluga pool on prefill/decode engines under `--policy auto` (`kvpath up --policy auto --prefill-nodes 1
--decode-nodes 1 --kv-tier pool`): a document prefilled once is written to the pool; a request on a fresh
session that starts with it reads it from the pool, on the decode engine (`local/pool`: a short append) or on
the prefill engine (`remote/pool`: a long one), with the greedy tokens of one prefill of the whole prompt."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from shared.bus import Bus, Registry
from shared.hashing import block_hashes
from shared.kvclient import IndexClient
from shared.protocol import ServiceInfo
from tests.cluster import UpProcess
from tests.integration.test_ampd import BLOCK, Reference, metric
from tests.integration.test_ampd import reference as reference  # the module's fixture, shared
from tests.integration.test_auto_policy import PD_PROFILE
from tests.integration.test_remote_tier import counter, engine_metrics

pytestmark = pytest.mark.slow
POOL_PLANS = ("local/pool", "remote/pool", "local/storage", "remote/storage", "remote/recompute", "local/hbm")


@pytest.fixture(scope="module")
def pool_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("pool-pd")
    profile = tmp / "profile.json"  # the decode engine prefills fast below 200 new tokens, 20x slower above
    profile.write_text(json.dumps(PD_PROFILE))
    pd = ("--prefill-nodes", "1", "--decode-nodes", "1", "--kv-tier", "pool", "--pool-bytes", str(32 << 20))
    up = UpProcess(tmp, "--policy", "auto", *pd, "--router-arg", f"--cost-profile {profile}")
    yield up
    assert up.stop() == 0, up.log()


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], session: str = "") -> Any:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    body["return_token_ids"] = True
    headers = {"X-Session-Id": session} if session else {}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def planned(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return {p: await metric(http, url, "kvpath_router_plan_total", f'plan="{p}"') for p in POOL_PLANS}


async def pool_hits(http: aiohttp.ClientSession, up: UpProcess, engine: str) -> float:
    text = await engine_metrics(http, up.services[engine])
    return counter(text, "kvpath_engine_kv_pool_blocks_total", outcome="hit")


async def until_pooled(up: UpProcess, prompt: list[int], num_blocks: int) -> None:
    """The index places the prompt's first `num_blocks` blocks in the pool (its announcements are async)."""
    bus = Bus(up.info["nats_url"], up.info["namespace"], name="test")
    await bus.connect()
    try:
        registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
        await registry.open()
        fmt = next(s.kv_format for s in await registry.list() if s.kv_format is not None)
        hashes = block_hashes(prompt, BLOCK, fmt.fingerprint)[:num_blocks]
        deadline = asyncio.get_running_loop().time() + 20
        while (await IndexClient(bus).match(hashes)).per_location.get("cxl:pool-0", 0) < num_blocks:
            assert asyncio.get_running_loop().time() < deadline, "the pool's blocks never reached the index"
            await asyncio.sleep(0.05)
    finally:
        await bus.close()


@pytest.mark.parametrize(
    ("append", "want", "engine"),
    [(40, "local/pool", "de1-n1"), (250, "remote/pool", "pe0-n0")],  # a short append stays local
)
async def test_a_fresh_session_reads_a_pooled_document_with_the_reference_tokens(
    pool_pd: UpProcess, reference: Reference, append: int, want: str, engine: str
) -> None:
    url, rng = pool_pd.url, random.Random(append)
    document = [rng.randrange(3, 250) for _ in range(300)]  # 4 full blocks
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        before = await planned(http, url)
        first = await complete(http, url, document)  # no session: the decode engine keeps nothing
        assert first["choices"][0]["token_ids"] == await reference.tokens(document, 16)
        assert (await planned(http, url))["remote/recompute"] == before["remote/recompute"] + 1
        await until_pooled(pool_pd, document, 300 // BLOCK)
        hits = await pool_hits(http, pool_pd, engine)
        prompt = document + [rng.randrange(3, 250) for _ in range(append)]
        before = await planned(http, url)
        out = await complete(http, url, prompt, session=f"fresh-{append}")
        after = await planned(http, url)
        assert out["choices"][0]["token_ids"] == await reference.tokens(prompt, 16)
        taken = [p for p in POOL_PLANS if after[p] == before[p] + 1]
        assert taken == [want], (before, after)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 300 // BLOCK * BLOCK
        assert await pool_hits(http, pool_pd, engine) == hits + 300 // BLOCK

"""`kvpath up --policy auto` (colocated engines): one cost model picks each request's engine and KV path,
counts its plan, and records its predicted TTFT against the measured one; stored prefixes are still loaded."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.cluster import UpProcess
from tests.integration.test_ampd import metric
from tests.integration.test_kv_reuse import complete

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def auto_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("auto")
    up = UpProcess(tmp, "--engines", "1", "--policy", "auto", "--kv-root", str(tmp / "store"))
    yield up
    assert up.stop() == 0, up.log()


async def test_auto_explains_each_plan_and_loads_stored_prefixes(
    auto_cluster: UpProcess, tmp_path: Path
) -> None:
    url = auto_cluster.url
    rng = random.Random(7)
    context: list[int] = []
    cached = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for n in (300, 90, 75):
            prompt = context + [rng.randrange(3, 250) for _ in range(n)]
            out = await complete(http, url, prompt, 16, "auto-session")
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            context = prompt + out["choices"][0]["token_ids"]
        plans = {
            label: await metric(http, url, "kvpath_router_plan_total", f'plan="{label}"')
            for label in ("local/recompute", "local/storage", "local/hbm", "local/pool")
        }
        errors = await metric(http, url, "kvpath_router_plan_ttft_error_seconds_count")
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached
    # the first turn has nothing stored; the next two find their prefix in storage on either engine's node
    assert plans == {"local/recompute": 1, "local/storage": 2, "local/hbm": 0, "local/pool": 0}, plans
    assert errors == 3  # every request's measured TTFT recorded against its prediction

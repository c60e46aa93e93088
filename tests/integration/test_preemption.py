"""A full cache preempts running sequences; the engine then reads back the blocks stored of them (their hits
and what it persisted meanwhile) instead of recomputing them, and the tokens are those of each request
served alone: on a colocated engine, a DualPath decode engine and an AMPD session decode engine."""

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
BLOCK = 64
PROMPT_TOKENS = 330  # 5 whole blocks stored per prompt, and a partial one
MAX_TOKENS = 200  # 9 blocks per sequence at the end: two of them do not fit in 16 blocks at once


TOPOLOGIES = {
    "colocated": (),
    "dualpath": ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "dualpath"),
    "ampd": ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "ampd"),
}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def small_cache(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpProcess]:
    """Engines of 16 blocks each, storage and index."""
    tmp: Path = tmp_path_factory.mktemp("preempt")
    args = (*TOPOLOGIES[request.param], "--kv-root", str(tmp / "store"), "--engine-arg=--num-kv-blocks 16")
    up = UpProcess(tmp, *args)
    try:
        yield up
    finally:
        assert up.stop() == 0, up.log()


async def greedy(http: aiohttp.ClientSession, url: str, prompt: list[int], session: str) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-Id": session}) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # fresh prompts; reloads are not hits
    return list(out["choices"][0]["token_ids"])


async def engine_counters(http: aiohttp.ClientSession, up: UpProcess) -> dict[str, float]:
    """The counters summed over every engine of the cluster."""
    wanted = {"kvpath_engine_preemptions", "kvpath_engine_kv_loaded_blocks", "kvpath_engine_prefill_tokens"}
    counters = dict.fromkeys(wanted, 0.0)
    for name, url in up.services.items():
        if not name.startswith(("engine", "pe", "de")):
            continue
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                counters[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return counters


async def test_preempted_sequences_reload_their_stored_prompt_and_keep_their_tokens(
    small_cache: UpProcess, cold_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(4)]
    before = await engine_counters(http, small_cache)
    sessions = [f"preempt-{i}" for i in range(len(prompts))]
    together = await asyncio.gather(
        *(greedy(http, small_cache.url, p, s) for p, s in zip(prompts, sessions, strict=True))
    )
    after = await engine_counters(http, small_cache)
    alone = [await greedy(http, cold_cluster.url, p, s) for p, s in zip(prompts, sessions, strict=True)]
    assert together == alone
    delta = {name: after[name] - before[name] for name in after}
    preemptions = delta["kvpath_engine_preemptions"]
    assert preemptions >= 1, delta
    # the preempted sequences read stored blocks back (there were none before: fresh prompts, no first hits)
    most = preemptions * ((PROMPT_TOKENS + MAX_TOKENS) // BLOCK)
    assert 1 <= delta["kvpath_engine_kv_loaded_blocks"] <= most, delta
    # and computed the prompts about once: recomputing a preempted prompt would add at least its stored blocks
    again = preemptions * (BLOCK + PROMPT_TOKENS % BLOCK + MAX_TOKENS)
    assert delta["kvpath_engine_prefill_tokens"] <= len(prompts) * PROMPT_TOKENS + again, delta


async def test_a_request_longer_than_the_whole_cache_ends_at_its_edge(
    small_cache: UpProcess, http: aiohttp.ClientSession
) -> None:
    """Alone, a sequence that outgrows all 16 blocks has nobody to preempt but itself, and coming back would
    meet the same cache: it ends `length` at the cache's last position instead of looping to its deadline."""
    prompt = [random.Random(11).randrange(3, 250) for _ in range(PROMPT_TOKENS)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 800, "ignore_eos": True, "temperature": 0}
    before = await engine_counters(http, small_cache)
    async with http.post(
        f"{small_cache.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
    ) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    assert out["choices"][0]["finish_reason"] == "length"
    # positions 0..1023 hold KV; the token sampled from the last one needs none
    assert out["usage"]["completion_tokens"] == 16 * BLOCK - PROMPT_TOKENS + 1
    after = await engine_counters(http, small_cache)
    assert after["kvpath_engine_preemptions"] == before["kvpath_engine_preemptions"]

"""SmolLM2 served end to end, colocated and DualPath: greedy tokens through the API equal transformers'
on the same GGUF file, on a cold first turn and on a second turn whose prefix is loaded from the KV store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from tests.cluster import UpProcess
from tests.reference import SmolLM2Reference

pytestmark = pytest.mark.slow
BLOCK = 64
NEW_TOKENS = 6
STORY = "Tell me about the history of the dragon of Wawel castle in Krakow, the legends and the people. " * 14


@pytest.fixture(scope="module", params=["colocated", "dualpath"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_cluster: UpProcess
) -> Iterator[UpProcess]:
    if request.param == "colocated":  # `kvpath up` serving SmolLM2, shared with the README's examples
        yield smollm2_cluster
        return
    topology = ["--prefill-nodes", "1", "--decode-nodes", "1"]
    up = UpProcess(tmp_path_factory.mktemp(request.param), *topology, model="smollm2")
    yield up
    assert up.stop() == 0, up.log()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": "s"}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def test_greedy_turns_equal_transformers_cold_and_from_the_kv_store(
    cluster: UpProcess, http: aiohttp.ClientSession, smollm2_reference: SmolLM2Reference
) -> None:
    messages = [{"role": "user", "content": STORY}]
    first = await _chat(http, cluster.url, messages)
    prompt = first["prompt_token_ids"]
    assert len(prompt) > 4 * BLOCK
    answer = first["choices"][0]
    assert answer["token_ids"] == smollm2_reference.greedy(tuple(prompt), NEW_TOKENS)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    messages += [
        {"role": "assistant", "content": answer["message"]["content"]},
        {"role": "user", "content": "Shorter, please."},
    ]
    second = await _chat(http, cluster.url, messages)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(prompt) // BLOCK * BLOCK  # turn 1's full blocks were loaded, not recomputed
    expected = smollm2_reference.greedy(tuple(second["prompt_token_ids"]), NEW_TOKENS)
    assert second["choices"][0]["token_ids"] == expected


async def test_a_context_past_one_staging_segment_is_stored_and_the_cache_holds_two_full_contexts(
    smollm2_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    """SmolLM2's fp32 blocks are 2.9 MB: a 1,600-token first step fills 25, more than the 64 MiB staging
    segment of before held (22), which lost the whole chain, so the next turn recomputed everything."""
    url = smollm2_cluster.url
    prompt = [300 + (i * 7919) % 19_000 for i in range(1600)]
    for turn, tokens in enumerate((prompt, [*prompt, *range(400, 420)])):
        body = {"model": "smollm2", "prompt": tokens, "max_tokens": 1, "temperature": 0}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            cached = (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (0 if turn == 0 else len(prompt) // BLOCK * BLOCK), (turn, cached)
    engine = next(u for name, u in smollm2_cluster.services.items() if name.startswith("engine"))
    async with http.get(f"{engine}/metrics") as resp:
        metrics = await resp.text()
    total = next(line for line in metrics.splitlines() if line.startswith("kvpath_engine_kv_blocks_total"))
    assert float(total.split()[-1]) >= 2 * 8192 // BLOCK  # two sequences of SmolLM2's full context

"""Tenants and `cache_salt` on every disaggregated and session topology, not only the colocated one: a
salted request is served (the plans the P/D dispatchers rebuild keep the chain's salt, which the engines
check), and a session id is the caller's own (two tenants, or two salts, naming the same session never
share its binding or the KV resident on its decode engine: `shared.hashing.session_key`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
A = {"Authorization": "Bearer sk-tenant-a-0123456789"}
B = {"Authorization": "Bearer sk-tenant-b-9876543210"}
PROMPT = [(j * 7) % 240 + 3 for j in range(200)]  # 3 full blocks of 64
TOPOLOGIES = {
    "dualpath": ("--prefill-nodes", "1", "--decode-nodes", "1"),
    "ampd": ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "ampd"),
    "auto": ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "auto"),
}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp(f"tenants-{request.param}")
    keys = tmp / "keys"
    keys.write_text(f"{A['Authorization'][7:]} team-a\n{B['Authorization'][7:]} team-b\n")
    up = UpProcess(tmp, *TOPOLOGIES[request.param], f"--router-arg=--api-key-file={keys}")
    yield up
    assert up.stop() == 0, up.log()


async def _complete(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], prompt: list[int], **extra: Any
) -> tuple[int, list[int]]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, **extra}
    async with http.post(
        f"{url}/v1/completions", json=body, headers={**headers, "X-Session-Id": "s"}
    ) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["token_ids"]


async def test_a_session_and_its_kv_belong_to_the_tenant_and_salt_that_made_them(
    cluster: UpProcess, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    url = cluster.url
    cached, tokens = await _complete(http, url, A, PROMPT)
    assert cached == 0
    # tenant B names A's session with A's prompt: served, the same tokens, and not a token of A's KV
    assert await _complete(http, url, B, PROMPT) == (0, tokens)
    # A's next turn still finds its own KV (resident on its decode engine, or stored)
    turn2 = [*PROMPT, *tokens, *range(10, 60)]
    cached, _ = await _complete(http, url, A, turn2)
    assert cached >= 192
    # the same session under another cache_salt is another session: nothing of it is reused
    cached, _ = await _complete(http, url, A, turn2, cache_salt="project-x")
    assert cached == 0

"""The OpenAI API behind API keys (a real router and engine): 401 in OpenAI's shape without a key or with a
wrong one, 200 with any configured key, probes and metrics open; a body over the limit is a JSON 413."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from services.router.auth import ApiKeys
from shared.bus import Bus
from tests.cluster import Stack, wait_ready

KEYS = "sk-team-a-0123456789 team-a\nsk-team-b-9876543210 team-b  # second tenant\n\n# comment\n"


async def test_api_keys_and_body_limit(stack: tuple[Stack, Bus], tmp_path: Path) -> None:
    s, bus = stack
    key_file = tmp_path / "keys"
    key_file.write_text(KEYS)
    router_args = ("--http-port", "0", "--api-key-file", str(key_file), "--max-request-bytes", "4096")
    s.start("router", "router-0", *router_args, "--no-use-kv-cache")
    s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    url = (await wait_ready(bus, {"router-0", "engine-0"}, s.procs))["router-0"].http_url
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer sk-wrong-0000000000"}, {"Authorization": "Basic x"}):
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
                err = (await resp.json())["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        for key in ("sk-team-a-0123456789", "sk-team-b-9876543210"):
            headers = {"Authorization": f"Bearer {key}"}
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
            async with http.get(f"{url}/v1/models", headers=headers) as resp:
                assert resp.status == 200
        for path in ("/health", "/ready", "/metrics"):
            async with http.get(f"{url}{path}") as resp:
                assert resp.status == 200, path
        headers = {"Authorization": "Bearer sk-team-a-0123456789"}
        big = {"model": "tiny", "prompt": "x" * 8000, "max_tokens": 2}
        async with http.post(f"{url}/v1/completions", json=big, headers=headers) as resp:
            assert resp.status == 413 and resp.content_type == "application/json"
            assert (await resp.json())["error"]["code"] == "request_too_large"


def test_key_tenants_and_constant_work() -> None:
    keys = ApiKeys.load(["sk-dev-key-123:dev", "sk-solo-key-456"], "")
    assert keys.tenant_of("Bearer sk-dev-key-123") == "dev"
    solo = keys.tenant_of("bearer sk-solo-key-456")
    assert solo.startswith("key-") and solo != keys.tenant_of("Bearer sk-dev-key-123")
    assert not ApiKeys.load([], "").enabled


async def test_tenants_share_cached_kv_only_with_the_same_salt(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    """The attack of the issue: tenant B sends tenant A's prompt and reads `cached_tokens`. With tenants
    salting the chain, B never hits A's blocks (so learns nothing), A still hits its own, and `cache_salt`
    splits one tenant's cache further; tokens stay those of a recompute."""
    s, bus = stack
    key_file = tmp_path / "keys"
    key_file.write_text(KEYS)
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    s.start("engine", "engine-0")
    s.start("router", "router-0", "--http-port", "0", "--api-key-file", str(key_file))
    url = (await wait_ready(bus, {"index-0", "storage-0", "engine-0", "router-0"}, s.procs))[
        "router-0"
    ].http_url
    prompt = [(j * 7) % 240 + 3 for j in range(200)]  # 3 full blocks of 64: 192 cacheable tokens
    a = {"Authorization": "Bearer sk-team-a-0123456789"}
    b = {"Authorization": "Bearer sk-team-b-9876543210"}

    async def cached(headers: dict[str, str], **extra: str) -> tuple[int, list[int]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        body |= {"return_token_ids": True, **extra}
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["token_ids"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        first = await cached(a)
        assert first[0] == 0
        assert await cached(a) == (192, first[1])  # a tenant hits its own blocks
        assert await cached(b) == (0, first[1])  # another tenant: never a hit, nothing to learn
        assert await cached(b) == (192, first[1])  # ... but its own blocks now
        assert await cached(a, cache_salt="project-x") == (0, first[1])  # a salt splits the tenant's cache
        assert await cached(a, cache_salt="project-x") == (192, first[1])
        assert await cached(b, cache_salt="project-x") == (0, first[1])  # same salt, other tenant: no
        async with http.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "cache_salt": 5}, headers=a
        ) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "cache_salt"

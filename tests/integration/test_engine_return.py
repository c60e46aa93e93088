"""The only engine restarts (as `kvpath up` or Kubernetes restarts it): requests wait for it to come back
instead of a 503, and a stream it was decoding migrates to its new process; past `engine_return_wait_s` a
request that finds no engine is the 503 it was."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from shared.bus import Bus
from tests.cluster import Stack, wait_ready
from tests.integration.test_ampd import metric

ROUTER_ARGS = ("--http-port", "0", "--engine-silence-timeout-s", "1.0", "--no-use-kv-cache")
ENGINE_ARGS = ("--no-persist-kv", "--no-load-kv")


async def test_the_only_engine_restarting_holds_requests_and_resumes_its_stream(
    stack: tuple[Stack, Bus],
) -> None:
    """Killed mid-stream and started again: a request sent meanwhile is served by the new process with the
    same tokens (before: a 503 at once), and the stream goes on there with the whole run's text (before: it
    ended with the engine's loss)."""
    s, bus = stack
    router = s.start("router", "router-0", *ROUTER_ARGS)
    engine = s.start("engine", "engine-0", *ENGINE_ARGS)
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    url = ready["router-0"].http_url
    body = {"model": "tiny", "prompt": "come back", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            whole = (await resp.json())["choices"][0]["text"]
        async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as stream:
            head = await stream.content.readuntil(b"\n\n")
            engine.kill()
            later = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body))
            await wait_ready(bus, {"router-0"}, s.procs)  # the router is not held up meanwhile
            s.start("engine", "engine-0", *ENGINE_ARGS)
            events = (head + await stream.read()).decode().split("\n\n")
        resp = await later
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["text"] == whole
        waits = await metric(http, url, "kvpath_router_engine_return_waits_total")
    chunks = [orjson.loads(e[len("data: ") :]) for e in events[:-2]]
    assert events[-2:] == ["data: [DONE]", ""] and all("error" not in c for c in chunks), chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    # the request waited (the migration too, unless the router heard the new process first)
    assert waits >= 1 and "migrated after" in router.log()


async def test_past_the_return_wait_a_request_finding_no_engine_is_a_503(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    s.start("router", "router-0", *ROUTER_ARGS, "--engine-return-wait-s", "0.5")
    engine = s.start("engine", "engine-0", *ENGINE_ARGS)
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    url = ready["router-0"].http_url
    body = {"model": "tiny", "prompt": "gone", "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        engine.kill()
        started = time.monotonic()
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 503, await resp.text()
            assert (await resp.json())["error"]["code"] == "no_engine_available"
        assert time.monotonic() - started < 10  # the window, not the request's deadline
        waits = await metric(http, url, "kvpath_router_engine_return_waits_total")
    assert waits == 1


@pytest.mark.parametrize("policy", ["ampd", "auto"])
async def test_a_turn_waits_for_its_only_decode_engine_to_restart(
    stack: tuple[Stack, Bus], policy: str
) -> None:
    """AMPD or auto on 1P1D, the decode engine SIGKILLed, its silence not heard (a minute's timeout): the
    turn's send finds no service answering it, so it is left out until it reports, and the turn waits for
    it to come back instead of a 503 at once."""
    s, bus = stack
    silence = ("--engine-silence-timeout-s", "60")
    router_args = (*ROUTER_ARGS[:2], "--no-use-kv-cache", "--policy", policy, *silence)
    s.start("router", "router-0", *router_args)
    s.start("engine", "pe-0", "--role", "prefill", *ENGINE_ARGS)
    de = s.start("engine", "de-0", "--role", "decode", "--session-kv", *ENGINE_ARGS)
    ready = await wait_ready(bus, {"router-0", "pe-0", "de-0"}, s.procs, num_engines=2)
    url = ready["router-0"].http_url
    body = {"model": "tiny", "prompt": [5] * 300, "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            whole = (await resp.json())["choices"][0]["text"]
        de.kill()
        later = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body))
        await wait_ready(bus, {"router-0"}, s.procs)
        s.start("engine", "de-0", "--role", "decode", "--session-kv", *ENGINE_ARGS)
        resp = await later
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["text"] == whole
        assert await metric(http, url, "kvpath_router_engine_return_waits_total") == 1

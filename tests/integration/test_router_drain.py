"""A router told to stop (SIGTERM: a rolling update, a scale-down, `kvpath up` ending) drains: new requests
get a 503 at once, open streams finish within the drain timeout, and those still open near its end get an
error event and `[DONE]` and are aborted on their engines before the router lets go of the bus."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from shared.bus import Bus
from tests.cluster import Stack, wait_ready
from tests.integration.test_ampd import metric
from tests.integration.test_api import engine_idle, wait_until

pytestmark = pytest.mark.slow

ARGS = ("--http-port", "0", "--no-use-kv-cache")


async def test_a_stopping_router_refuses_new_requests_and_ends_open_streams_in_time(
    stack: tuple[Stack, Bus],
) -> None:
    s, bus = stack
    router = s.start("router", "router-0", *ARGS, "--drain-timeout-s", "3")
    s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    url, engine_url = ready["router-0"].http_url, ready["engine-0"].http_url
    long = {"model": "tiny", "prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    short = {"model": "tiny", "prompt": "y", "max_tokens": 4, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.post(f"{url}/v1/completions", json=long) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # streaming (8,000 tokens: ~10 s here, past the drain)
            router.terminate()
            stopped_at = time.monotonic()
            refused = await _refusal(http, url, short)
            tail = await resp.content.read()  # to the end of the stream
            ended_after_s = time.monotonic() - stopped_at
        events = [orjson.loads(e[len(b"data: ") :]) for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
        assert tail.endswith(b"data: [DONE]\n\n")
        assert events[-1]["error"]["code"] == "service_unavailable"
        assert ended_after_s < 3 + 1
        assert refused == (503, "service_unavailable")
        await asyncio.to_thread(router.proc.wait, 10)
        assert router.proc.returncode == 0, router.log()
        await wait_until(lambda: engine_idle(http, engine_url), timeout_s=8)  # aborted, not decoded on
        aborted = await metric(http, engine_url, "kvpath_engine_requests_finished_total", 'reason="abort"')
        assert aborted == 1


async def _refusal(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> tuple[int, str]:
    """A request sent while the router drains: its status and error code, once the router took the stop
    (its health turned 503)."""
    await wait_until(lambda: _is_draining(http, url), timeout_s=5)
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, (await resp.json())["error"]["code"]


async def _is_draining(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(f"{url}/health") as resp:
        return resp.status == 503

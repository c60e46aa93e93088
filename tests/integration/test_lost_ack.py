"""A task whose ack never came back: the engine took it, the router did not hear so.

A real engine process is stopped (SIGSTOP: a stall, as a long GC pause, a starved VM or a nats-server
restart gives) after a request was sent to it and until the router's ack timeout passed, then resumed. The
engine takes the task it finds waiting and acks it, but that ack is too late. The router, hearing the engine
report again, sends the same task once more, and the engine acks it again without running it twice.
Before, the router published an abort and tried another engine; with one engine that was a 503 (a
nats-server restart did the same: `kvpath up` probes with one decode engine), and with two, the same
request id ran on both while the abort of the first could be lost too.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from shared.bus import Bus
from tests.cluster import Stack, wait_ready
from tests.integration.test_ampd import metric
from tests.integration.test_api import wait_until

pytestmark = pytest.mark.slow

ROUTER_ARGS = ("--http-port", "0", "--no-use-kv-cache", "--task-ack-timeout-s", "0.5")


async def _complete(http: aiohttp.ClientSession, url: str, body: dict) -> list[int]:
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    return list(out["choices"][0]["token_ids"])


async def test_a_task_whose_ack_was_lost_is_acked_again_and_runs_once(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    router = s.start("router", "router-0", *ROUTER_ARGS)
    engine = s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    url, engine_url = ready["router-0"].http_url, ready["engine-0"].http_url
    body = {
        "model": "tiny", "prompt": [(5 * i) % 200 + 3 for i in range(48)], "max_tokens": 24, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    timeouts = 'kind="timeout"'
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        reference = await _complete(http, url, body)
        before = await metric(http, url, "kvpath_bus_errors_total", timeouts)
        os.kill(engine.proc.pid, signal.SIGSTOP)
        try:
            request = asyncio.ensure_future(_complete(http, url, body))

            async def ack_timed_out() -> bool:
                return await metric(http, url, "kvpath_bus_errors_total", timeouts) > before

            await wait_until(ack_timed_out, timeout_s=20)
        finally:
            os.kill(engine.proc.pid, signal.SIGCONT)
        got = await asyncio.wait_for(request, 30)
        assert got == reference
        assert await metric(http, url, "kvpath_router_tasks_resent_total") == 1
        # the engine ran it once: both requests finished there, no third
        finished = await metric(http, engine_url, "kvpath_engine_requests_finished_total")
    assert finished == 2, finished
    assert "acked again" in engine.log(), engine.log()
    assert "sending the task again" in router.log(), router.log()

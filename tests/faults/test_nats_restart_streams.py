"""`kvpath up` with one nats-server, SIGKILLed while 8 streams decode: the supervisor restarts it, every
service reconnects, and every stream still ends with all its tokens, those of the same request without
the fault. Core NATS loses the token batches in flight; the router sees the gaps and silences and its
engine sends those deltas again (`services/router/resend.py`). Before, each stream that lost a batch
failed with `engine_failed` ("token stream gap"), 6-11 of ~130 agent turns per restart in the probes, and
a lost last delta would have kept its stream open until the request's deadline."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
STREAMS, TOKENS = 8, 1500


async def _stream(
    http: aiohttp.ClientSession, url: str, prompt: list[int], started: asyncio.Event
) -> list[int]:
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": True, "return_token_ids": True,
    }  # fmt: skip
    tokens: list[int] = []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event: dict[str, Any] = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                tokens += choice.get("token_ids") or []
            if len(tokens) >= 20:
                started.set()
    return tokens


STALL_S = 5.0  # a nats-server frozen this long (SIGSTOP): past the router's engine silence timeout (3 s)


@pytest.mark.parametrize("fault", ["restart", "stall"])
async def test_streams_survive_a_nats_server_restart(tmp_path: Path, fault: str) -> None:
    """`restart`: SIGKILLed, `kvpath up` restarts it. `stall`: stopped for STALL_S, then continued (a frozen
    server or a partition: no connection drops, nothing moves): before, the router took the silence of every
    engine for their deaths and failed every stream, though the engines had decoded on."""
    up = UpProcess(tmp_path, "--router-arg=--stream-probe-s=1")
    try:
        prompts = [[(i * 13 + j * 7) % 250 + 3 for j in range(40)] for i in range(STREAMS)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            events = [asyncio.Event() for _ in prompts]
            reference = await asyncio.gather(*(_stream(http, up.url, p, asyncio.Event()) for p in prompts))
            streams = [
                asyncio.create_task(_stream(http, up.url, p, e)) for p, e in zip(prompts, events, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            assert not any(s.done() for s in streams), "streams too short to meet the fault"
            nats_pid = up.supervisor_state()["nats-server"]["pid"]
            if fault == "restart":
                os.kill(nats_pid, signal.SIGKILL)
            else:
                os.kill(nats_pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(STALL_S)  # the fault's length, not a wait for a condition
                finally:
                    os.kill(nats_pid, signal.SIGCONT)
            got = await asyncio.gather(*streams)
            async with http.get(f"{up.url}/metrics") as resp:
                metrics = await resp.text()
        assert up.supervisor_state()["nats-server"]["restarts"] == (1 if fault == "restart" else 0)
        assert [len(t) for t in got] == [TOKENS] * STREAMS
        assert got == reference
        failures = re.findall(r"^kvpath_router_engine_failures_total\{.*\} ([0-9.]+)$", metrics, re.M)
        assert sum(float(v) for v in failures) == 0
    finally:
        assert up.stop() == 0, up.log()

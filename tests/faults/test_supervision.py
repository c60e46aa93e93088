"""`kvpath up` heals: a SIGKILLed engine and a SIGKILLed nats-server are restarted (same service id, same
NATS port and JetStream store), counted in supervisor.json, and the cluster serves again without a hand
touching it."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
RECOVER_S = 90.0  # restart backoff + an engine's model load + reconnects, on a busy 2-core machine


def _serves(up: UpProcess) -> bool:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{up.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _wait(what: str, condition: object, timeout_s: float = RECOVER_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_a_killed_engine_and_a_killed_nats_server_are_restarted(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, "--kv-root", str(tmp_path / "kv"))
    try:
        assert _serves(up)
        before = up.supervisor_state()
        assert before["engine0-n0"]["restarts"] == 0 and before["nats-server"]["restarts"] == 0

        os.kill(before["engine0-n0"]["pid"], signal.SIGKILL)
        _wait("engine restarted", lambda: up.supervisor_state()["engine0-n0"]["restarts"] == 1)
        after = up.supervisor_state()["engine0-n0"]
        assert after["pid"] != before["engine0-n0"]["pid"] and after["last_exit_code"] == -signal.SIGKILL
        _wait("serving after the engine's restart", lambda: _serves(up))

        os.kill(before["nats-server"]["pid"], signal.SIGKILL)
        _wait("nats-server restarted", lambda: up.supervisor_state()["nats-server"]["restarts"] == 1)
        _wait("serving after the bus came back", lambda: _serves(up))
        assert up.proc.poll() is None  # the cluster never stopped
    finally:
        assert up.stop() == 0, up.log()
    log = up.log_path.read_text()
    assert "restarted engine0-n0 (restart 1" in log and "restarted nats-server (restart 1)" in log


def test_streams_of_an_engine_restarted_under_its_id_migrate_to_the_new_process(tmp_path: Path) -> None:
    """`kvpath up` restarts a killed engine so fast that its load reports never stop: the router still tells
    the new process from the old one (the reports' incarnation) and migrates the old one's streams to it
    (they run to their end) instead of leaving them open until their deadline. Before migration they ended
    with an error event."""
    import asyncio

    import aiohttp

    from loadgen.bench.fault_client import prompt, stream

    up = UpProcess(tmp_path, "--no-kv-store")

    async def run() -> tuple[str, str, float, int]:
        started = asyncio.Event()
        async with aiohttp.ClientSession() as http:
            task = asyncio.ensure_future(stream(http, up.url, prompt(1, 100), 2000, started=started))
            await asyncio.wait_for(started.wait(), 60)
            os.kill(up.supervisor_state()["engine0-n0"]["pid"], signal.SIGKILL)
            killed = time.monotonic()
            end = await task
        return end.outcome, end.message, time.monotonic() - killed, end.tokens

    try:
        outcome, message, seconds, tokens = asyncio.run(run())
        # the restart is told by the reports' incarnation, and the stream migrates to the new process; where
        # a restart outlasts the report timeout (a CUDA engine's start, a loaded host), the missing reports
        # end the stream first and no engine is left to take it: an error then, never a hang
        if outcome == "ok":
            assert tokens == 2000 and "migrated after" in (tmp_path / "logs" / "router-0.log").read_text()
        else:
            assert outcome == "error" and "stopped responding" in message, message
        assert seconds < 45  # ended by the restart, not by the request deadline or a hang (60 s)
    finally:
        assert up.stop() == 0, up.log()

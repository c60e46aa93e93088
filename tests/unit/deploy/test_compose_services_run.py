"""The compose file's kvpath commands, run for real as local processes (no Docker): every service turns
healthy for the image's health-check script on the port compose gives it, the DualPath cluster answers a
chat completion through the router, the dashboard's latency metrics fill, and SIGTERM drains every service."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.natsserver import NatsServer
from tests.unit.deploy.compose import Compose, command, environment, load_compose
from tests.unit.deploy.kvpath_cli import DEPLOY, REPO

pytestmark = pytest.mark.slow
STARTUP_DEADLINE_S = 90.0
POLL_S = 0.2  # readiness polling interval; every wait below has its own deadline

Running = dict[str, tuple[subprocess.Popen[bytes], int]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kvpath() -> list[str]:
    script = Path(sys.executable).parent / "kvpath"
    return [str(script)] if script.exists() else [sys.executable, "-m", "services.cli"]


def _healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEPLOY / "healthcheck.py"), "--timeout-s", "2"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"KVPATH_HTTP_PORT": str(port), "PATH": os.environ.get("PATH", "")},
    )


def _start(compose: Compose, name: str, nats_url: str, namespace: str, root: Path) -> tuple[Any, int]:
    svc = compose.services[name]
    port = _free_port()
    env = dict(os.environ, **environment(svc))
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT")  # no collector here
    # one host: the compose network's per-container ports and paths become distinct local ones
    env.update(KVPATH_NATS_URL=nats_url, KVPATH_NAMESPACE=namespace, KVPATH_HTTP_PORT=str(port))
    env.update(KVPATH_JETSTREAM_REPLICAS="1")  # one local nats-server stands in for the 3-node cluster
    argv = [a.replace("/var/lib/kvpath", str(root)) for a in command(svc)]
    with (root / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen([*_kvpath(), *argv], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return proc, port


@pytest.fixture
def running(nats_server: NatsServer, namespace: str, tmp_path: Path) -> Iterator[Running]:
    compose = load_compose()
    procs: Running = {}
    try:
        for name in compose.kvpath:
            procs[name] = _start(compose, name, nats_server.url, namespace, tmp_path)
        yield procs
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def _is_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def _wait_healthy(running: Running, logs: Path) -> None:
    """Poll /health in-process (cheap while engines load), then confirm with the image's check script."""
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    pending = set(running)
    while pending:
        for name in sorted(pending):
            proc, port = running[name]
            assert proc.poll() is None, f"{name} exited:\n{(logs / f'{name}.log').read_text()[-2000:]}"
            if _is_healthy(port):
                pending.discard(name)
        assert time.monotonic() < deadline, f"not healthy within {STARTUP_DEADLINE_S}s: {sorted(pending)}"
        time.sleep(POLL_S)
    for name, (_, port) in running.items():
        check = _healthcheck(port)
        assert check.returncode == 0, f"{name}: {check.stdout}"


def _chat(port: int, deadline_s: float) -> dict[str, Any]:
    """One chat completion; 503 (the router has not seen every engine's load report yet) is retried."""
    # greedy, past EOS: a sampled end of turn (the random `tiny` model draws one now and then) is no failure
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    deadline = time.monotonic() + deadline_s
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            body.encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                reply: dict[str, Any] = json.loads(resp.read())
                return reply
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(POLL_S)


def _histogram_count(port: int, family: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for metric in text_string_to_metric_families(text):
        if metric.name == family:
            return sum(s.value for s in metric.samples if s.name == f"{family}_count")
    return 0.0


def _log_tails(logs: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(logs.glob("*.log"))
    )


def test_compose_cluster_serves_and_stops_cleanly(running: Running, tmp_path: Path) -> None:
    _wait_healthy(running, tmp_path)
    compose = load_compose()
    (router,) = compose.by_service("router")
    try:
        reply = _chat(running[router][1], deadline_s=30)
    except urllib.error.HTTPError as exc:
        pytest.fail(f"chat completion failed: {exc.code} {exc.read()!r}\n{_log_tails(tmp_path)}")
    assert reply["usage"]["completion_tokens"] == 4
    assert _histogram_count(running[router][1], "kvpath_router_time_to_first_token_seconds") >= 1
    for name, (proc, port) in running.items():
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvpath_bus_messages_total" in metrics, name
        proc.send_signal(signal.SIGTERM)
    for name, (proc, port) in running.items():
        assert proc.wait(30) == 0, f"{name} did not drain cleanly\n{_log_tails(tmp_path)}"
        failed = _healthcheck(port)
        assert failed.returncode == 1 and "127.0.0.1" in failed.stdout, name

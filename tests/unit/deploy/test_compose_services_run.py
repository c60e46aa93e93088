"""The compose file's kvpath commands start for real (as local processes, no Docker) and the image's health
check script sees them healthy on the port compose gives them, then unhealthy once they stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.natsserver import NatsServer
from tests.unit.deploy.compose import command, environment, load_compose
from tests.unit.deploy.kvpath_cli import DEPLOY, REPO

pytestmark = pytest.mark.slow
STARTUP_DEADLINE_S = 60.0


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


@pytest.fixture
def running(
    nats_server: NatsServer, namespace: str, tmp_path: Path
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], int]]]:
    compose = load_compose()
    # one container per kvpath service kind (index, storage, engine, router), in compose file order: every
    # command shape starts for real; the other containers differ only in flag values the parse tests check
    first_of_kind = {p.service: name for name, p in reversed(compose.kvpath.items())}
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for name in first_of_kind.values():
            svc = compose.services[name]
            port = _free_port()
            env = dict(os.environ, **environment(svc))
            env.pop("OTEL_EXPORTER_OTLP_ENDPOINT")  # no collector here
            env.update(
                KVPATH_NATS_URL=nats_server.url, KVPATH_NAMESPACE=namespace, KVPATH_HTTP_PORT=str(port)
            )
            argv = [a.replace("/var/lib/kvpath", str(tmp_path)) for a in command(svc)]
            with (tmp_path / f"{name}.log").open("wb") as log:
                proc = subprocess.Popen(
                    [*_kvpath(), *argv], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
                )
            procs[name] = (proc, port)
        yield procs
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def test_compose_services_start_healthy_and_stop_cleanly(
    running: dict[str, tuple[subprocess.Popen[bytes], int]], tmp_path: Path
) -> None:
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    pending = set(running)
    while pending:
        for name in sorted(pending):
            proc, port = running[name]
            assert proc.poll() is None, f"{name} exited:\n{(tmp_path / f'{name}.log').read_text()[-2000:]}"
            if _healthcheck(port).returncode == 0:
                pending.discard(name)
        assert time.monotonic() < deadline, f"not healthy within {STARTUP_DEADLINE_S}s: {sorted(pending)}"
        time.sleep(0.2)  # poll interval of the readiness loop above (the condition has its deadline)
    for name, (proc, port) in running.items():
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvpath_bus_messages_total" in metrics, name
        proc.send_signal(signal.SIGTERM)
    for name, (proc, port) in running.items():
        assert proc.wait(30) == 0, f"{name} did not drain cleanly"
        failed = _healthcheck(port)
        assert failed.returncode == 1 and "127.0.0.1" in failed.stdout, name

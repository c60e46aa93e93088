"""Real service processes for tests and benchmarks: `kvpath up` in a subprocess (UpProcess), or services
started one by one against a given nats-server (ServiceProcess, ServiceStack); stopped as a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from services.up.forked import FRESH_ENV, ForkedService
from shared.natsserver import NatsServer
from shared.shm import remove_segments


class UpProcess:
    """`kvpath up --http-port 0 --ready-file ...` in its own process group, stopped like a user would."""

    def __init__(
        self, tmp_path: Path, *args: str, timeout_s: float = 180.0, model: str | None = "tiny"
    ) -> None:
        """`model`: tests and benchmarks serve the fast embedded model unless they name one (here or with
        `--model` in `args`); None keeps `kvpath up`'s own default (SmolLM2), as the README's commands do."""
        if model is not None and "--model" not in args:
            args = ("--model", model, *args)
        self.ready_file = tmp_path / f"ready-{time.monotonic_ns()}.json"
        self.log_path = tmp_path / f"up-{time.monotonic_ns()}.log"
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--http-port",
            "0",
            "--ready-file",
            str(self.ready_file),
            "--log-dir",
            str(tmp_path / "logs"),
            *args,
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.info = self._wait_ready(timeout_s)
        self.url: str = self.info["url"]
        self.kv_root = Path()  # set by tests that pass --kv-root
        self.services: dict[str, str] = self.info["services"]

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                text = self.ready_file.read_text()
                if text:
                    return json.loads(text)
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpath up exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)  # a stat per step: a short step costs nothing and every cluster start waits less
        self.stop()
        raise TimeoutError(f"kvpath up not ready in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def supervisor_state(self) -> dict[str, dict[str, int]]:
        """pid, restarts and last exit code per child, as the supervisor last wrote them (supervisor.json)."""
        return dict(json.loads(Path(self.info["supervisor_file"]).read_text()))

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


class ServiceProcess:
    """One `kvpath serve <service> ...` process against a given NATS server and namespace: forked from the
    warm fork server (`forked.py`), or a fresh interpreter with KVPATH_FRESH_PROCESSES=1."""

    def __init__(
        self, tmp_path: Path, service: str, *args: str, nats_url: str, namespace: str, service_id: str
    ) -> None:
        self.service_id = service_id
        self.log_path = tmp_path / f"{service_id}.log"
        env = dict(
            os.environ,
            KVPATH_NATS_URL=nats_url,
            KVPATH_NAMESPACE=namespace,
            KVPATH_SERVICE_ID=service_id,
            PYTHONUNBUFFERED="1",
        )
        self._log = open(self.log_path, "wb")
        self.proc: subprocess.Popen[bytes] | ForkedService
        if os.environ.get(FRESH_ENV):
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "serve", service, *args],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        else:
            self.proc = ForkedService(["serve", service, *args], env=env, log_path=self.log_path)
        self._is_terminated = False
        self.ended_on_purpose = False  # killed or told to stop by its starter (not a crash)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def kill(self) -> None:
        self.ended_on_purpose = True
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: it drains and exits), once: a second SIGTERM that lands after its event
        loop closed would kill it by the signal's default action; `stop()` waits for it."""
        self.ended_on_purpose = True
        if self.proc.poll() is None and not self._is_terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._is_terminated = True

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.wait(10)  # ended by now: its exit code (-signal when a signal ended it)


class ServiceStack:
    """Services started one by one in one namespace of one nats-server; `stop()` ends them (router first)
    and removes the shared-memory segments of any it had to kill."""

    def __init__(self, tmp: Path, nats: NatsServer, namespace: str) -> None:
        self.tmp, self.nats, self.namespace = tmp, nats, namespace
        self.procs: list[ServiceProcess] = []

    def start(self, service: str, service_id: str, *args: str) -> ServiceProcess:
        proc = ServiceProcess(
            self.tmp, service, *args, nats_url=self.nats.url, namespace=self.namespace, service_id=service_id
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        # as `kvpath up` stops its children: all told at once (router first), so that they drain in parallel
        # rather than one after another, then each waited for
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            p.stop()
        remove_segments(f"kvpath-{self.namespace}-")

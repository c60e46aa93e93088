"""`kvpath up` in a subprocess: what tests and benchmarks use to get a real cluster and stop it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class UpProcess:
    """`kvpath up --http-port 0 --ready-file ...` in its own process group, stopped like a user would."""

    def __init__(self, tmp_path: Path, *args: str, timeout_s: float = 180.0) -> None:
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
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"kvpath up not ready in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

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

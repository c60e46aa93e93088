"""Clusters for integration and e2e tests: `kvpath up` (UpProcess) or services started one by one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

from services.up.process import UpProcess
from shared.bus import Bus, Registry
from shared.natsserver import NatsServer
from shared.protocol import ServiceInfo
from shared.shm import remove_segments

__all__ = ["ServiceProcess", "Stack", "UpProcess", "router_sees", "wait_ready"]


class ServiceProcess:
    """One `kvpath serve <service> ...` process against a given NATS server and namespace."""

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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", service, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode


async def wait_ready(
    bus: Bus,
    ids: set[str],
    procs: list[ServiceProcess],
    timeout_s: float = 60,
    num_engines: int | None = None,
) -> dict:
    """Every service registered as ready, and the router seeing every engine's load reports."""
    registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
    await registry.open()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if num_engines is None:
        num_engines = sum(1 for i in ids if i.startswith("engine"))
    while True:
        ready = {s.service_id: s for s in await registry.list() if s.status == "ready"}
        has_router = "router-0" in ids
        if ids <= ready.keys() and (
            not has_router or await router_sees(ready["router-0"].http_url, num_engines)
        ):
            return ready
        for p in procs:
            assert p.proc.poll() is None, p.log()
        assert loop.time() < deadline, f"not ready: {ids - ready.keys()}"
        await asyncio.sleep(0.1)


async def router_sees(url: str, num_engines: int) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as resp:
        return resp.status == 200 and (await resp.json())["engines"] >= num_engines


class Stack:
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
        for p in reversed(self.procs):
            p.stop()
        remove_segments(f"kvpath-{self.namespace}-")  # those of processes a test killed

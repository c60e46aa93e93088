"""`kvpath up`: a whole local cluster from one command.

Starts nats-server (JetStream on, free port) unless `--nats-url` is given, then every service as its own
process (`kvpath serve ...`), waits until each is registered and healthy, prints the URL, and on Ctrl-C or
SIGTERM stops everything it started: children first (SIGTERM, then SIGKILL after a deadline), then NATS,
then its temporary directory. Children also die with it if it is killed (PR_SET_PDEATHSIG).

Once ready it supervises: a child (nats-server included) that exits is restarted after a backoff
(`RestartPolicy`), with the same service id, so the cluster heals; each restart is logged and counted in
`<log dir>/supervisor.json` (pid, restarts, last exit code per child). The cluster stops only on Ctrl-C /
SIGTERM, or when one child keeps crashing (more than `max_restarts` within `window_s`): then it names the
child and its log and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from gpu.model_spec import DEFAULT_MODEL, EMBEDDED_MODELS, PACKAGED_MODELS
from services.up.forked import FRESH_ENV, ForkedService, start_fork_server, stop_fork_server
from services.up.supervision import Child, RestartPolicy, all_healthy, die_with_parent, tail, write_atomically
from services.up.topology import (
    ClusterSpec,
    ProcessSpec,
    add_policy_args,
    cluster_processes,
    spec_from_args,
)
from shared.bus import Bus, Registry
from shared.errors import KvpathError, ServiceUnavailableError
from shared.logs import setup_logging
from shared.natsserver import NatsCluster
from shared.protocol import ServiceInfo
from shared.shm import remove_segments

# the services `kvpath up` forks from its fork server: those that import torch (~2 s of a start or restart);
# the others import in ~0.5 s and, started fresh, do not carry the fork server's torch in their RSS
FORKED_SERVICES = ("engine",)
log = logging.getLogger("kvpath.up")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start a local cluster (NATS + every service) in the foreground",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nats-url", default="", help="use this NATS server instead of starting one")
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        help="start this many nats-servers as one cluster (JetStream replicated up to 3 ways; services get "
        "the whole seed list, so losing one server loses nothing)",
    )
    p.add_argument("--namespace", default="", help="bus namespace (default: a fresh one per run)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address of the API")
    p.add_argument("--http-port", "--port", type=int, default=8000, help="API port (0 picks a free one)")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model: {', '.join((*PACKAGED_MODELS, *EMBEDDED_MODELS))}, an HF checkpoint folder or a .gguf "
        "file (tiny: random weights, fast, for tests)",
    )
    p.add_argument("--engines", type=int, default=1, help="colocated engines (when no P/D nodes are given)")
    p.add_argument("--prefill-nodes", type=int, default=0, help="prefill nodes (disaggregated mode)")
    p.add_argument("--decode-nodes", type=int, default=0, help="decode nodes (disaggregated mode)")
    p.add_argument("--engines-per-node", type=int, default=1, help="engines per prefill/decode node")
    add_policy_args(p)
    p.add_argument("--pool-bytes", type=int, default=0, help="pool / remote store capacity (0: default)")
    p.add_argument(
        "--storage-bandwidth", type=float, default=0, help="bytes/s per node storage NIC (0: unlimited)"
    )
    p.add_argument("--kv-root", default="", help="block store directory (default: a temporary one)")
    p.add_argument("--no-kv-store", action="store_true", help="no storage/index: every turn recomputes")
    p.add_argument("--block-size", type=int, default=64, help="KV block size in tokens")
    p.add_argument("--log-dir", default="", help="service logs (default: inside the temporary directory)")
    p.add_argument("--ready-file", default="", help="write {url, nats_url, ...} as JSON here once healthy")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for readiness")
    p.add_argument("--engine-arg", action="append", default=[], help="extra flag for every engine (repeat)")
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for the router (repeat)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    setup_logging("up", level="INFO")
    tmp = tempfile.mkdtemp(prefix="kvpath-up-")
    try:
        spec = spec_from_args(args, args.kv_root or str(Path(tmp) / "kv"))
        cluster = LocalCluster(
            spec,
            tmp_dir=tmp,
            nats_url=args.nats_url,
            nats_cluster=args.nats_cluster,
            namespace=args.namespace or f"up{uuid.uuid4().hex[:8]}",
            log_dir=args.log_dir or str(Path(tmp) / "logs"),
        )
        return asyncio.run(cluster.serve(ready_file=args.ready_file, startup_timeout_s=args.startup_timeout))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class LocalCluster:
    def __init__(
        self,
        spec: ClusterSpec,
        *,
        tmp_dir: str,
        nats_url: str,
        namespace: str,
        log_dir: str,
        nats_cluster: int = 1,
    ) -> None:
        if nats_cluster < 1:
            raise SystemExit(f"kvpath up: --nats-cluster must be >= 1, got {nats_cluster}")
        self.spec = spec
        self.tmp_dir = tmp_dir
        self.nats_url = nats_url
        self.namespace = namespace
        self.log_dir = log_dir
        self.nats_cluster_size = nats_cluster
        self.jetstream_replicas = min(3, nats_cluster)
        self.nats: NatsCluster | None = None
        self.children: list[Child] = []
        self.service_urls: dict[str, str] = {}
        self.restart_policy = RestartPolicy()
        self.nats_exits: dict[int, list[float]] = {}  # per server of our cluster
        self.nats_restarts: dict[int, int] = {}
        self.supervisor_file = str(Path(log_dir) / "supervisor.json")
        self._stop = asyncio.Event()

    async def serve(self, *, ready_file: str, startup_timeout_s: float) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            url = await self._start(startup_timeout_s)
        except (KvpathError, OSError, TimeoutError) as exc:
            msg = exc.message if isinstance(exc, KvpathError) else repr(exc)
            log.error("cluster failed to start: %s", msg)
            self._shutdown()
            return 1
        print(f"kvpath ready: {url}", flush=True)
        if ready_file:
            info = {
                "url": url,
                "nats_url": self.nats_url,
                "namespace": self.namespace,
                "log_dir": self.log_dir,
                "services": self.service_urls,
                "tmp_dir": self.tmp_dir,
                "supervisor_file": self.supervisor_file,
            }
            await asyncio.to_thread(write_atomically, Path(ready_file), json.dumps(info))
        code = await self._watch()
        self._shutdown()
        return code

    async def _start(self, timeout_s: float) -> str:
        os.makedirs(self.log_dir, exist_ok=True)
        if not os.environ.get(FRESH_ENV):
            start_fork_server()  # it imports torch while NATS starts
        if not self.nats_url:
            self.nats = NatsCluster(
                self.nats_cluster_size, store_dir=str(Path(self.tmp_dir) / "nats"), log_dir=self.log_dir
            )
            await asyncio.to_thread(self.nats.start)
            self.nats_url = self.nats.url
        if self.spec.kv_root:
            os.makedirs(self.spec.kv_root, exist_ok=True)
        await asyncio.to_thread(_materialize_model, self.spec.model)
        procs = cluster_processes(self.spec)
        # fresh interpreters first: a fork waits for the fork server's imports (the list keeps the order,
        # which is the stop order's reverse)
        forked_last = sorted(range(len(procs)), key=lambda i: procs[i].service in FORKED_SERVICES)
        started = {i: self._spawn(procs[i]) for i in forked_last}
        self.children.extend(started[i] for i in range(len(procs)))
        return await self._wait_ready(time.monotonic() + timeout_s)

    def _spawn(self, pspec: ProcessSpec) -> Child:
        log_path = str(Path(self.log_dir) / f"{pspec.name}.log")
        env = dict(
            os.environ,
            KVPATH_NATS_URL=self.nats_url,
            KVPATH_NAMESPACE=self.namespace,
            KVPATH_SERVICE_ID=pspec.name,
            KVPATH_JETSTREAM_REPLICAS=str(self.jetstream_replicas),
            PYTHONUNBUFFERED="1",
        )
        argv = ["serve", pspec.service, *pspec.args]
        proc: subprocess.Popen[bytes] | ForkedService
        if os.environ.get(FRESH_ENV) or pspec.service not in FORKED_SERVICES:
            with open(log_path, "ab") as out:
                cmd = [sys.executable, "-m", "services.cli", *argv]
                proc = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
                )
        else:  # forked from the fork server, which imported torch once
            proc = ForkedService(
                argv, env=env, log_path=log_path, new_session=False, death_signal=signal.SIGTERM
            )
        log.info("started %s pid=%d log=%s", pspec.name, proc.pid, log_path)
        return Child(pspec, proc, log_path)

    async def _wait_ready(self, deadline: float) -> str:
        bus = Bus(self.nats_url, self.namespace, name="kvpath-up", jetstream_replicas=self.jetstream_replicas)
        await bus.connect()
        registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
        try:
            await registry.open()
            want = {c.spec.name for c in self.children}
            num_engines = sum(1 for c in self.children if c.spec.service == "engine")
            async with aiohttp.ClientSession() as http:
                while True:
                    self._check_children()
                    ready = {s.service_id: s for s in await registry.list() if s.status == "ready"}
                    if want <= ready.keys() and await all_healthy(
                        http, [ready[n] for n in want], num_engines
                    ):
                        self.service_urls = {n: ready[n].http_url for n in sorted(want)}
                        return ready["router-0"].http_url
                    if time.monotonic() > deadline:
                        missing = sorted(want - ready.keys())
                        raise ServiceUnavailableError(f"services not ready in time: {', '.join(missing)}")
                    with contextlib.suppress(TimeoutError):  # short steps: readiness is seen soon after it
                        await asyncio.wait_for(self._stop.wait(), 0.05)
                    if self._stop.is_set():
                        raise ServiceUnavailableError("interrupted during startup")
        finally:
            await bus.close()

    def _check_children(self) -> None:
        for child in self.children:
            code = child.proc.poll()
            if code is not None:
                raise ServiceUnavailableError(
                    f"{child.spec.name} exited with code {code}:\n{tail(child.log_path)}"
                )

    async def _watch(self) -> int:
        """Supervise until Ctrl-C / SIGTERM (0) or a crash loop (1)."""
        await asyncio.to_thread(self._write_supervisor)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.25)
            if self._stop.is_set():
                break
            now = time.monotonic()
            if not await self._supervise_nats(now):
                return 1
            for child in self.children:
                if not await self._supervise(child, now):
                    return 1
        log.info("stopping")
        return 0

    async def _supervise(self, child: Child, now: float) -> bool:
        """Restart the child when it is due; False when it keeps crashing."""
        if child.restart_at is None:
            code = child.proc.poll()
            if code is None:
                return True
            child.exits.append(now)
            child.last_exit_code = code
            delay = self.restart_policy.backoff_s(child.exits, now)
            if delay is None:
                log.error(
                    "%s keeps crashing (%d exits within %.0f s, last code %s); stopping the cluster; "
                    "its log: %s\n%s",
                    child.spec.name, len(child.exits), self.restart_policy.window_s, code, child.log_path,
                    tail(child.log_path),
                )  # fmt: skip
                return False
            log.error(
                "%s exited with code %s; restarting it in %.1f s\n%s",
                child.spec.name, code, delay, tail(child.log_path, 10),
            )  # fmt: skip
            child.restart_at = now + delay
            return True
        if now >= child.restart_at:
            child.restart_at = None
            child.proc = self._spawn(child.spec).proc
            child.restarts += 1
            log.warning("restarted %s (restart %d, pid %d)", child.spec.name, child.restarts, child.proc.pid)
            await asyncio.to_thread(self._write_supervisor)
        return True

    async def _supervise_nats(self, now: float) -> bool:
        """Restart a server of our NATS cluster on its ports and store (JetStream keeps its streams; the
        others keep serving meanwhile when there are any); clients reconnect through their seed list."""
        if self.nats is None:
            return True
        for i, server in enumerate(self.nats.servers):
            proc = server.proc  # None: a restart that failed, to be tried again
            if proc is not None and proc.poll() is None:
                continue
            code = proc.poll() if proc is not None else None
            exits = self.nats_exits.setdefault(i, [])
            exits.append(now)
            delay = self.restart_policy.backoff_s(exits, now)
            name = self._nats_name(i)
            if delay is None:
                log.error("%s keeps crashing (last code %s); stopping the cluster; log: %s", name, code,
                          server.log_path)  # fmt: skip
                return False
            log.error("%s exited with code %s; restarting it in %.1f s", name, code, delay)
            await asyncio.sleep(delay)
            try:
                await asyncio.to_thread(server.start)
            except (KvpathError, OSError) as exc:  # counted as another exit on the next pass
                log.error("%s did not restart: %r", name, exc)
                continue
            self.nats_restarts[i] = self.nats_restarts.get(i, 0) + 1
            log.warning("restarted %s (restart %d)", name, self.nats_restarts[i])
            await asyncio.to_thread(self._write_supervisor)
        return True

    def _nats_name(self, i: int) -> str:
        return "nats-server" if self.nats_cluster_size == 1 else f"nats-{i}"

    def _write_supervisor(self) -> None:
        """pid, restarts and last exit code of every child (and of our nats-server) in supervisor.json."""
        state: dict[str, dict[str, object]] = {
            c.spec.name: {"pid": c.proc.pid, "restarts": c.restarts, "last_exit_code": c.last_exit_code}
            for c in self.children
        }
        for i, server in enumerate(self.nats.servers if self.nats is not None else []):
            if server.proc is not None:
                state[self._nats_name(i)] = {"pid": server.proc.pid, "restarts": self.nats_restarts.get(i, 0)}
        write_atomically(Path(self.supervisor_file), json.dumps(state, indent=1))

    def _shutdown(self, timeout_s: float = 15.0) -> None:
        # in stages, each stopped before the next is told to: the router (stops taking requests), then the
        # engines (their last writes still reach storage and the KV tier), then storage, the tier, the index
        deadline = time.monotonic() + timeout_s
        for stage in _SHUTDOWN_STAGES:
            group = [c for c in self.children if _shutdown_stage(c.spec.kind) == stage]
            for child in reversed(group):
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", child.spec.name)
                    child.proc.kill()
                    child.proc.wait(5)
        if self.nats is not None:
            self.nats.stop()
        stop_fork_server()
        remove_segments(f"kvpath-{self.namespace}-")  # node buffers of services that had to be killed


def _materialize_model(model: str) -> None:
    from gpu.model_spec import resolve_model

    resolve_model(model)


_SHUTDOWN_STAGES = ("router", "engine", "services")


def _shutdown_stage(kind: str) -> str:
    return kind if kind in ("router", "engine") else "services"

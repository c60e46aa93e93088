"""Round trips of the CXL-RPC transport against NATS request/reply, for `kvpath bench beluga`.

Both transports serve the same server logic from a server process of their own: the pool's own request
handler (`services/cxlpool/core.py`) over a block table holding a committed 64-block chain, answering LOOKUPs
of the chain's first 1 or 64 hashes (all hits, no pin). Each client is a process of its own making
back-to-back calls, one in flight (the paper's QD=1 ping-pong), for `duration_s` after a warm-up; every
client starts on the same "go". Transports: "shm" (`RpcClient.call`), "shm-async" (`RpcClient.acall` on
an asyncio loop), "nats" (`NatsRpcClient.acall` through a nats-server). RTT percentiles are over every
call of every client; ops/s is the sum of the clients' rates. `measure_idle_cpu` is the CPU a server with
one attached, silent client burns (it should sleep on its futex and wake only for housekeeping).

Children: `python -m loadgen.bench.beluga_rpc serve|client ...` print one JSON line when ready (and clients
one with their count when done); a server stops when its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import select
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from services.cxlpool.block_table import BlockTable
from services.cxlpool.core import PoolCore
from shared.bus import Bus
from shared.cxl.client import RpcClient
from shared.cxl.nats_rpc import NatsRpcClient, NatsRpcServer
from shared.cxl.pool_ops import Op, encode_lookup
from shared.cxl.rpc_config import RpcConfig
from shared.cxl.rpc_status import Handler
from shared.cxl.server import RpcServer
from shared.natsserver import NatsServer
from shared.protocol.kv import PoolInfo
from shared.protocol.subjects import Subjects

TRANSPORTS = ("shm", "shm-async", "nats")
_LOOKUP_OP = int(Op.LOOKUP)
_CHAIN_BLOCKS = 64
_START_TIMEOUT_S = 60.0  # spawning 8 interpreters on a loaded 2-core box takes a while


@dataclass(slots=True)
class RttResult:
    transport: str
    num_clients: int
    num_hashes: int  # per LOOKUP
    payload_bytes: int
    num_calls: int
    p50_us: float
    p99_us: float
    ops_per_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _chain() -> tuple[list[int], list[int]]:
    hashes = [1000 + i for i in range(_CHAIN_BLOCKS)]
    return hashes, [7, *hashes[:-1]]


def pool_handler() -> Handler:
    """The pool's request handler over a table that holds one committed chain of `_CHAIN_BLOCKS` blocks."""
    table = BlockTable(4 * _CHAIN_BLOCKS)
    hashes, parents = _chain()
    table.alloc(hashes, parents, "bench", lease_ns=10**18, now_ns=0)
    table.commit(hashes, [0] * len(hashes), "bench")
    info = PoolInfo(
        pool_id="bench",
        epoch=1,
        fingerprint="bench",
        block_size=64,
        slot_bytes=4096,
        num_slots=table.num_slots,
        num_devices=1,
        interleave_bytes=4096,
        device_paths=[],
    )
    core = PoolCore(table, info, default_lease_ms=1000)
    return lambda client_id, op, payload: core.handle(f"bench:{client_id}", op, payload)


def lookup_payload(num_hashes: int) -> bytes:
    return encode_lookup(_chain()[0][:num_hashes], pin=False, lease_ms=0)


def measure_rtt(
    transport: str,
    *,
    num_clients: int = 1,
    num_hashes: int = 1,
    duration_s: float = 2.0,
    nats_url: str | None = None,
) -> RttResult:
    """RTT percentiles and throughput of `num_clients` client processes against one server process."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if not 1 <= num_hashes <= _CHAIN_BLOCKS:
        raise ValueError(f"num_hashes must be in 1..{_CHAIN_BLOCKS}, got {num_hashes}")
    with tempfile.TemporaryDirectory(prefix="kvpath-rpc-bench-") as tmp, _server(transport, nats_url) as srv:
        outs = [Path(tmp) / f"client-{i}.npy" for i in range(num_clients)]
        args = [f"--num-hashes={num_hashes}", f"--duration-s={duration_s}", *srv.target]
        with _children(
            [["client", f"--transport={transport}", f"--out={out}", *args] for out in outs]
        ) as procs:
            for proc in procs:
                _read_json(proc, _START_TIMEOUT_S)
            for proc in procs:  # "go" to all at once
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            done = [_read_json(proc, duration_s + _START_TIMEOUT_S) for proc in procs]
        latencies_ns = np.concatenate([np.load(out) for out in outs])
    p50_ns, p99_ns = np.percentile(latencies_ns, [50, 99])
    return RttResult(
        transport=transport,
        num_clients=num_clients,
        num_hashes=num_hashes,
        payload_bytes=len(lookup_payload(num_hashes)),
        num_calls=int(latencies_ns.size),
        p50_us=round(float(p50_ns) / 1e3, 2),
        p99_us=round(float(p99_ns) / 1e3, 2),
        ops_per_s=round(sum(d["calls"] / d["elapsed_s"] for d in done)),
    )


def measure_idle_cpu(*, duration_s: float = 3.0, settle_s: float = 0.5) -> float:
    """CPU percent (of one core) of a shm server process with one attached client that sends nothing."""
    with _server("shm", None) as srv:
        client = RpcClient(srv.target[0].removeprefix("--name="))
        try:
            client.call(_LOOKUP_OP, lookup_payload(1), 5.0)
            server = psutil.Process(srv.pid)
            time.sleep(settle_s)  # let it finish spinning after the call and go to sleep
            before = server.cpu_times()
            time.sleep(duration_s)
            after = server.cpu_times()
        finally:
            client.close()
    busy_s = (after.user - before.user) + (after.system - before.system)
    return round(100.0 * busy_s / duration_s, 3)


def run_rpc_bench(
    *,
    transports: tuple[str, ...] = ("shm", "nats"),
    client_counts: tuple[int, ...] = (1, 8),
    hash_counts: tuple[int, ...] = (1, 64),
    duration_s: float = 2.0,
    nats_url: str | None = None,
) -> list[RttResult]:
    """Every combination; a private nats-server is started when NATS is measured and no URL is given."""
    with _nats_url(nats_url if "nats" in transports else "") as url:
        return [
            measure_rtt(t, num_clients=n, num_hashes=h, duration_s=duration_s, nats_url=url)
            for t in transports
            for n in client_counts
            for h in hash_counts
        ]


@contextmanager
def _nats_url(url: str | None) -> Iterator[str]:
    """`url`, or (None) a nats-server of our own for the duration."""
    if url is not None:
        yield url
        return
    with NatsServer() as server:
        yield server.url


# ----------------------------------------------------------------------------------------- parent side


@dataclass(slots=True)
class _ServerProcess:
    target: list[str]  # the arguments that point a client at it
    pid: int


@contextmanager
def _server(transport: str, nats_url: str | None) -> Iterator[_ServerProcess]:
    """A server process for `transport` (shm-async clients talk to the shm server)."""
    with _nats_url(nats_url if transport == "nats" else "") as url:
        if transport == "nats":
            target = [f"--url={url}", f"--namespace=bench{uuid.uuid4().hex[:8]}"]
        else:
            target = [f"--name=kvpath-rpc-bench-{uuid.uuid4().hex[:8]}"]
        kind = "nats" if transport == "nats" else "shm"
        with _children([["serve", f"--transport={kind}", *target]]) as (proc,):
            yield _ServerProcess(target, int(_read_json(proc, _START_TIMEOUT_S)["pid"]))


@contextmanager
def _children(arg_lists: list[list[str]]) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        for args in arg_lists:
            cmd = [sys.executable, "-m", "loadgen.bench.beluga_rpc", *args]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        yield procs
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()  # a server's signal to stop
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _read_json(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"bench child {proc.args!r} did not answer within {timeout_s:.0f}s")
    return dict(json.loads(line))


# ------------------------------------------------------------------------------------------ child side


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _serve_shm(args: argparse.Namespace) -> None:
    server = RpcServer(args.name, pool_handler(), config=RpcConfig(payload_bytes=65600))
    server.start()
    try:
        _say(pid=psutil.Process().pid)
        sys.stdin.read()  # until the parent closes our stdin
    finally:
        server.close()


async def _serve_nats(args: argparse.Namespace) -> None:
    bus = Bus(args.url, args.namespace, name="rpc-bench-server")
    await bus.connect()
    server = NatsRpcServer(bus, Subjects(args.namespace).cxl_rpc("bench"), pool_handler())
    await server.start()
    _say(pid=psutil.Process().pid)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()
    await bus.close()


def _run_shm_client(args: argparse.Namespace, payload: bytes) -> tuple[list[int], float]:
    client = RpcClient(args.name)
    call, clock = client.call, time.perf_counter_ns
    warmup_end = time.monotonic() + 0.2
    while time.monotonic() < warmup_end:
        call(_LOOKUP_OP, payload, 5.0)
    _say(ready=True)
    sys.stdin.readline()
    latencies_ns: list[int] = []
    begin_ns = clock()
    end_ns = begin_ns + int(args.duration_s * 1e9)
    while (start := clock()) < end_ns:
        call(_LOOKUP_OP, payload, 5.0)
        latencies_ns.append(clock() - start)
    elapsed_s = (clock() - begin_ns) / 1e9
    client.close()
    return latencies_ns, elapsed_s


async def _run_async_client(args: argparse.Namespace, payload: bytes) -> tuple[list[int], float]:
    bus: Bus | None = None
    client: RpcClient | NatsRpcClient
    if args.transport == "nats":
        bus = Bus(args.url, args.namespace, name="rpc-bench-client")
        await bus.connect()
        client = NatsRpcClient(bus, Subjects(args.namespace).cxl_rpc("bench"))
    else:
        client = RpcClient(args.name)
    acall, clock = client.acall, time.perf_counter_ns
    warmup_end = time.monotonic() + 0.2
    while time.monotonic() < warmup_end:
        await acall(_LOOKUP_OP, payload, 5.0)
    _say(ready=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    latencies_ns: list[int] = []
    begin_ns = clock()
    end_ns = begin_ns + int(args.duration_s * 1e9)
    while (start := clock()) < end_ns:
        await acall(_LOOKUP_OP, payload, 5.0)
        latencies_ns.append(clock() - start)
    elapsed_s = (clock() - begin_ns) / 1e9
    client.close()
    if bus is not None:
        await bus.close()
    return latencies_ns, elapsed_s


def _client(args: argparse.Namespace) -> None:
    payload = lookup_payload(args.num_hashes)
    if args.transport == "shm":
        latencies_ns, elapsed_s = _run_shm_client(args, payload)
    else:
        latencies_ns, elapsed_s = asyncio.run(_run_async_client(args, payload))
    np.save(args.out, np.asarray(latencies_ns, dtype=np.int64))
    _say(calls=len(latencies_ns), elapsed_s=elapsed_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadgen.bench.beluga_rpc")
    parser.add_argument("role", choices=("serve", "client"))
    parser.add_argument("--transport", choices=TRANSPORTS, required=True)
    parser.add_argument("--name", default="", help="shm: segment name")
    parser.add_argument("--url", default="", help="nats: server URL")
    parser.add_argument("--namespace", default="", help="nats: bus namespace")
    parser.add_argument("--num-hashes", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=2.0)
    parser.add_argument("--out", default="", help="client: where to save the latencies (.npy)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # a closing bus logs its disconnect as a warning
    if args.role == "client":
        _client(args)
    elif args.transport == "nats":
        asyncio.run(_serve_nats(args))
    else:
        _serve_shm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

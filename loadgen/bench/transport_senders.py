"""`kvpath bench transport --senders K`: K sender processes stream into one receiver process at once.

Each sender keeps one write in flight (the latency-bound case of a layer-by-layer pipeline) into its own
slots of one region, every write tagged; the receiver consumes every notice. A KV receiver in a serving
cluster looks like this: a decode engine taking prefilled KV from several prefill engines, a holder
answering several requesters. Per message size and backend it reports the aggregate GB/s (all senders'
bytes over the slowest sender's time) and each sender's median time per write. With `--spin-us 0` it
shows what polling buys (or costs) when several streams share the receiver's event loop and the cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from shared.transport.config import TransportConfig
from shared.transport.receiver import KvReceiver
from shared.transport.sender import KvSender

_SLOTS = 8  # per sender


def bench_config(spin_us: float | None, backends: list[str]) -> TransportConfig:
    """Both benches' transport config: the given backends, `spin_us` when set (else its default)."""
    config = TransportConfig(backends=backends)
    if spin_us is not None:
        config.spin_us = spin_us
    return config


def parse_cpus(text: str) -> list[int]:
    """`--cpus`: comma-separated CPU ids, each one this process may run on."""
    try:
        cpus = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise SystemExit(f"--cpus takes CPU ids like 0,1, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not set(cpus) <= allowed:
        raise SystemExit(f"--cpus {text!r}: pick from the CPUs this process may use, {sorted(allowed)}")
    return cpus


def pin_self(cpus: list[int] | None, index: int) -> list[int]:
    """Pin this process to cpus[index] (wrapping) when `cpus` is given; the CPUs it may run on now."""
    if cpus:
        os.sched_setaffinity(0, {cpus[index % len(cpus)]})
    return sorted(os.sched_getaffinity(0))


def measure(
    sizes: list[int],
    backends: list[str],
    senders: int,
    total: int,
    spin_us: float | None,
    cpus: list[int] | None = None,
) -> list[dict[str, Any]]:
    """A row per size: {size_bytes, messages (per sender), senders, <backend>: aggregate GB/s,
    <backend>_us_per_write: the senders' median time per write, cpus: where each process ran}. `cpus`:
    the receiver on the first, sender j on the (j + 1)-th, wrapping."""
    rows = []
    for size in sizes:
        count = max(1, total // size // senders)
        row: dict[str, Any] = {"size_bytes": size, "messages": count, "senders": senders}
        for backend in backends:
            seconds, row["cpus"] = _one(size, count, senders, backend, spin_us, cpus)
            row[backend] = senders * count * size / max(seconds) / 1e9
            row[f"{backend}_us_per_write"] = statistics.median(seconds) / count * 1e6
        rows.append(row)
    return rows


def _one(
    size: int, count: int, senders: int, backend: str, spin_us: float | None, cpus: list[int] | None
) -> tuple[list[float], dict[str, Any]]:
    """Each sender's seconds for its `count` writes, all streaming into one fresh receiver at once, and
    the CPUs each process ran on."""
    me = [sys.executable, "-m", "loadgen.bench.transport_senders"]
    spin, where = str(spin_us), ",".join(map(str, cpus or []))
    rx = subprocess.Popen(
        [*me, "rx", str(senders), str(size), str(count), where, spin],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    txs: list[subprocess.Popen[str]] = []
    try:
        assert rx.stdout is not None
        hello = json.loads(rx.stdout.readline())
        endpoint = json.dumps(hello["endpoint"])
        for j in range(senders):
            txs.append(
                subprocess.Popen(
                    [*me, "tx", endpoint, str(j), backend, str(size), str(count), where, spin],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        sender_cpus = []
        for tx in txs:
            assert tx.stdout is not None
            ready = json.loads(tx.stdout.readline() or "null")
            if not isinstance(ready, dict) or "ready" not in ready:
                raise RuntimeError(f"bench sender did not connect over {backend}")
            sender_cpus.append(ready["ready"])
        for tx in txs:  # all at once
            assert tx.stdin is not None
            tx.stdin.write("go\n")
            tx.stdin.flush()
        seconds = [float(json.loads(tx.stdout.readline())) for tx in txs if tx.stdout is not None]
        if json.loads(rx.stdout.readline()) != "consumed":
            raise RuntimeError("bench receiver did not consume every notice")
        for tx in txs:  # the senders close first: the receiver then sees goodbyes, not lost peers
            tx.wait(timeout=30)
        assert rx.stdin is not None
        rx.stdin.close()
        return seconds, {"receiver": hello["cpus"], "senders": sender_cpus}
    finally:
        for proc in [*txs, rx]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


async def _receive(senders: int, size: int, count: int, cpus: list[int], spin_us: float | None) -> None:
    where = pin_self(cpus, 0)
    rx = KvReceiver(bench_config(spin_us, ["shm", "tcp"]), receiver_id="bench-rx")
    await rx.start()
    rx.register_region("buf", size * _SLOTS * senders)
    print(json.dumps({"endpoint": rx.endpoint(), "cpus": where}), flush=True)

    async def consume(j: int) -> None:
        for i in range(count):
            await rx.wait("buf", j * count + i, timeout_s=120)

    await asyncio.gather(*(consume(j) for j in range(senders)))
    print(json.dumps("consumed"), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes it
    await rx.close()


async def _send(
    endpoint: dict[str, Any], j: int, backend: str, size: int, count: int, cpus: list[int], spin: float | None
) -> None:
    where = pin_self(cpus, j + 1)
    tx = KvSender(bench_config(spin, [backend]), sender_id=f"bench-tx{j}")
    try:
        peer = await tx.connect(endpoint, timeout_s=10, backend=backend)
        data = np.random.default_rng(j).integers(0, 256, size, dtype=np.uint8)
        base = j * _SLOTS * size
        await peer.write("buf", base, np.ones(_SLOTS * size, np.uint8), timeout_s=60)  # fault the slots in
        print(json.dumps({"ready": where}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        start = time.perf_counter()
        for i in range(count):
            await peer.write("buf", base + (i % _SLOTS) * size, data, tag=j * count + i, timeout_s=60)
        print(json.dumps(time.perf_counter() - start), flush=True)
    finally:
        await tx.close()


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    spin_arg = None if rest[-1] == "None" else float(rest[-1])
    cpu_arg = [int(c) for c in rest[-2].split(",") if c]
    if role == "rx":
        asyncio.run(_receive(int(rest[0]), int(rest[1]), int(rest[2]), cpu_arg, spin_arg))
    else:
        asyncio.run(
            _send(json.loads(rest[0]), int(rest[1]), rest[2], int(rest[3]), int(rest[4]), cpu_arg, spin_arg)
        )

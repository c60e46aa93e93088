"""The pool under concurrent client processes: no reader ever sees an unpublished, torn or recycled block
(eviction under pressure included), and a killed reader's pins are released so its blocks can go."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from shared.bus import Bus
from shared.cxl.nats_rpc import NatsRpcClient
from shared.cxl.pool_ops import Op
from tests.cluster import Stack, wait_ready

pytestmark = pytest.mark.slow
CHILD = "tests.integration.cxlpool.pool_child"
REPO = Path(__file__).resolve().parents[3]


def child(mode: str, s: Stack, seconds: float, seed: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", CHILD, mode, s.nats.url, s.namespace, "pool-0", str(seconds), str(seed)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def result(proc: subprocess.Popen[str], timeout_s: float = 60) -> dict[str, int]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return dict(orjson.loads(out.strip().splitlines()[-1]))


async def stats(bus: Bus) -> dict[str, int]:
    status, data = await NatsRpcClient(bus, bus.subjects.cxl_rpc("pool-0")).acall(Op.STATS, b"", 2.0)
    assert status == 0
    return dict(orjson.loads(data))


async def start_pool(s: Stack, bus: Bus, capacity_bytes: int) -> None:
    s.start("cxlpool", "pool-0", "--model", "tiny", "--capacity-bytes", str(capacity_bytes))
    await wait_ready(bus, {"pool-0"}, s.procs, num_engines=0)


async def test_readers_never_see_a_torn_or_recycled_block(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    await start_pool(s, bus, 32 * 131072)  # 32 slots for 144 distinct blocks: constant eviction
    procs = [child("write", s, 4.0, seed) for seed in (1, 2)] + [
        child("read", s, 4.0, seed) for seed in (3, 4)
    ]
    writes = [result(p) for p in procs[:2]]
    reads = [result(p) for p in procs[2:]]
    assert sum(r["bad_blocks"] for r in reads) == 0, reads
    assert sum(r["hit_blocks"] for r in reads) > 100, reads  # readers really read
    assert sum(w["committed"] for w in writes) > 100, writes
    final = await stats(bus)
    assert final["evicted"] > 0 and final["num_pinned"] == 0 and final["num_leases"] == 0, final


async def test_a_killed_readers_pins_are_released(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    await start_pool(s, bus, 64 * 131072)
    result(child("write", s, 1.0, 1))
    holder = child("pin", s, 3600.0, 9)
    assert holder.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 30)
    assert orjson.loads(line)["pinned"] > 0
    assert (await stats(bus))["num_pinned"] > 0
    os.kill(holder.pid, signal.SIGKILL)
    holder.communicate(timeout=10)  # reaps it and closes its pipes
    deadline = asyncio.get_running_loop().time() + 10  # the lease lasts 10 minutes: only death releases it
    while (current := await stats(bus))["num_pinned"]:
        assert asyncio.get_running_loop().time() < deadline, current
        await asyncio.sleep(0.05)
    assert current["num_leases"] == 0

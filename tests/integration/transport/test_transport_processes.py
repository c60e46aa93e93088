"""Two real processes per test: bytes arrive exact over shm and tcp in both directions, and a peer
killed mid-transfer is an error on the other side, not a hang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from shared.errors import DeadlineExceededError, TransportError
from shared.shm import segment_path
from shared.transport import KvReceiver, KvSender, TransportConfig
from shared.transport.segments import sweep_stale_segments

HELPER = Path(__file__).with_name("peer_proc.py")
SIZE = 24 << 20
BACKENDS = ["shm", "tcp"]
ROOT = Path(__file__).resolve().parents[3]


@asynccontextmanager
async def child(*args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HELPER),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        yield proc
    finally:
        if proc.returncode is None and args[0] == "receiver":
            assert proc.stdin is not None
            proc.stdin.close()  # end of commands: the receiver closes and unlinks its segments
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10)


async def read_json(proc: asyncio.subprocess.Process, timeout_s: float = 30) -> Any:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    assert line, "child exited without answering"
    return json.loads(line)


async def ask(proc: asyncio.subprocess.Process, command: str) -> Any:
    assert proc.stdin is not None
    proc.stdin.write(command.encode() + b"\n")
    await proc.stdin.drain()
    return await read_json(proc)


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_receiver_in_another_process(backend: str) -> None:
    async with child("receiver", "--size", str(SIZE)) as rx:
        endpoint = await read_json(rx)
        tx = KvSender(TransportConfig(backends=["shm", "tcp"]), sender_id="pe-main")
        try:
            peer = await tx.connect(endpoint, timeout_s=10, backend=backend)
            data = pattern(5, SIZE)
            await peer.write_many(
                "buf",
                [(0, data[: SIZE // 2]), (SIZE // 2, data[SIZE // 2 :])],
                tag=1,
                meta=b"m",
                timeout_s=30,
            )
            assert await ask(rx, "wait 1 10 pe-main") == {
                "tag": 1,
                "meta": "m",
                "nbytes": SIZE,
                "peer": "pe-main",
            }
            assert (await ask(rx, f"digest 0 {SIZE}"))["digest"] == xxhash.xxh3_64_hexdigest(data)
        finally:
            await tx.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sender_in_another_process(backend: str) -> None:
    rx = KvReceiver(TransportConfig(backends=["shm", "tcp"]))
    await rx.start()
    region = rx.register_region("buf", 72 << 20)
    try:
        args = [
            "sender",
            "--endpoint",
            json.dumps(rx.endpoint()),
            "--backend",
            backend,
            "--seed",
            "9",
            "--size",
            str(SIZE),
            "--sender-id",
            "pe-child",
        ]
        async with child(*args) as tx:
            big = await rx.wait("buf", 1, timeout_s=30, peer_id="pe-child")
            assert (big.meta, big.nbytes) == (b"big", SIZE)
            assert np.array_equal(region.view(0, SIZE), pattern(9, SIZE))
            small = await rx.wait("buf", 2, timeout_s=30, peer_id="pe-child")
            assert (small.meta, small.nbytes) == (b"small", 2000 * 512)
            rng = np.random.default_rng(10)  # the helper's small_blocks(9)
            offsets = (64 << 20) + rng.permutation(4000)[:2000] * 1024
            blocks = rng.integers(0, 256, (2000, 512), dtype=np.uint8)
            whole = region.array()
            assert np.array_equal(np.stack([whole[o : o + 512] for o in offsets.tolist()]), blocks)
            assert await read_json(tx) == "done"
    finally:
        await rx.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sender_killed_mid_transfer_fails_the_waiter(backend: str) -> None:
    rx = KvReceiver(TransportConfig(backends=["shm", "tcp"]))
    await rx.start()
    rx.register_region("buf", SIZE)
    try:
        args = [
            "sender",
            "--endpoint",
            json.dumps(rx.endpoint()),
            "--backend",
            backend,
            "--size",
            str(SIZE),
            "--sender-id",
            "pe-doomed",
            "--loop",
        ]
        async with child(*args) as tx:
            assert await read_json(tx) == "ready"
            # a notice this sender owes but will never send; the deadline is far away on purpose
            waiter = asyncio.ensure_future(rx.wait("buf", 7, timeout_s=60, peer_id="pe-doomed"))
            tx.send_signal(signal.SIGKILL)
            with pytest.raises(TransportError, match="pe-doomed disconnected"):
                await waiter
        assert "pe-doomed" not in rx.live_peers()
    finally:
        await rx.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_receiver_killed_fails_the_sender(backend: str) -> None:
    tx = KvSender(TransportConfig(backends=["shm", "tcp"]), sender_id="pe-main")
    try:
        async with child("receiver", "--size", str(SIZE)) as rx:
            endpoint = await read_json(rx)
            peer = await tx.connect(endpoint, timeout_s=10, backend=backend)
            await peer.write("buf", 0, b"before", tag=1, timeout_s=10)
            rx.send_signal(signal.SIGKILL)
            await rx.wait()
            probe = segment_path(endpoint["shm_probe"])
            assert probe.exists()  # a killed receiver cannot unlink its segments...
            sweep_stale_segments()
            assert not list(probe.parent.glob(probe.name.removesuffix("probe") + "*"))  # ...the next one does
            with pytest.raises(TransportError, match="lost"):
                for tag in range(2, 100):  # bytes may still fit in socket buffers for a write or two
                    await peer.write("buf", 0, pattern(1, 1 << 20), tag=tag, timeout_s=10)
            assert not peer.is_open
    finally:
        await tx.close()


async def test_stalled_receiver_is_a_deadline_not_a_hang() -> None:
    tx = KvSender(TransportConfig(backends=["shm", "tcp"]), sender_id="pe-main")
    try:
        async with child("receiver", "--size", str(64 << 20)) as rx:
            endpoint = await read_json(rx)
            tcp = await tx.connect(endpoint, timeout_s=10, backend="tcp")
            shm = await tx.connect(endpoint, timeout_s=10, backend="shm")
            await shm.write("buf", 0, b"warm", tag=1, timeout_s=10)
            await tcp.write(
                "buf", 0, b"warm", timeout_s=10
            )  # region looked up: the deadline hits the payload
            big = pattern(2, 64 << 20)
            rx.send_signal(signal.SIGSTOP)  # alive but not reading: kernel buffers fill, acks stop
            try:
                with pytest.raises(DeadlineExceededError):
                    await tcp.write("buf", 0, big, tag=2, timeout_s=0.5)
                assert not tcp.is_open  # half a frame went out: this connection is done
                with pytest.raises(DeadlineExceededError):
                    await shm.write("buf", 0, b"x" * 1024, tag=3, timeout_s=0.5)
            finally:
                rx.send_signal(signal.SIGCONT)
            assert shm.is_open  # only the ack was late: the connection is intact and usable again
            await shm.write("buf", 0, b"again", tag=4, timeout_s=10)
            assert await ask(rx, "wait 4 10") == {"tag": 4, "meta": "", "nbytes": 5, "peer": "pe-main"}
    finally:
        await tx.close()

"""Both backends end to end in one process: bytes exact, notices after data, bounds, regions, deadlines."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from shared.errors import DeadlineExceededError, OverloadedError, TransportError
from shared.shm import segment_path
from shared.transport import KvReceiver, KvSender, TransportConfig
from shared.transport import receiver as receiver_module
from shared.transport.segments import _NAME as SEGMENT_NAME

BACKENDS = ["shm", "tcp"]


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_default_choice_on_one_host_is_shm() -> None:
    async def run() -> str:
        rx = KvReceiver(TransportConfig(backends=["shm", "tcp"]))
        await rx.start()
        tx = KvSender(TransportConfig(backends=["shm", "tcp"]))
        try:
            peer = await tx.connect(rx.endpoint(), timeout_s=5)
            return peer.backend
        finally:
            await tx.close()
            await rx.close()

    assert asyncio.run(run()) == "shm"


async def test_endpoint_announces_backends_and_regions(receiver: KvReceiver) -> None:
    endpoint = receiver.endpoint()
    assert endpoint["kind"] == "kv_endpoint" and endpoint["backends"] == ["shm", "tcp"]
    assert endpoint["regions"] == {"buf": receiver.region("buf").size_bytes}
    services = receiver.service_endpoints()
    assert (
        services["tcp"] == f"{endpoint['address']}:{endpoint['port']}"
        and services["shm"] == endpoint["host_id"]
    )


async def test_shm_control_frames_take_an_owner_only_unix_socket_else_tcp(
    receiver: KvReceiver, sender: KvSender, tmp_path: Path
) -> None:
    endpoint = receiver.endpoint()
    path = Path(endpoint["shm_socket"])
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert path.parent == segment_path("probe").parent and SEGMENT_NAME.match(path.name)  # swept with them
    # a socket file this sender cannot see, and an entry naming some other Unix socket of the host
    unreachable = dict(endpoint, shm_socket=str(path.parent / f"kvpath-rx-1-1-{'0' * 12}-ctl"))
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(tmp_path / "other.sock"))
    other.listen()
    other.setblocking(False)
    hostile = dict(endpoint, shm_socket=str(tmp_path / "other.sock"))
    cases = [(endpoint, "shm", "unix"), (endpoint, "tcp", "tcp"), (unreachable, "shm", "tcp")]
    cases.append((hostile, "shm", "tcp"))
    for tag, (target, backend, control) in enumerate(cases):
        peer = await sender.connect(target, timeout_s=5, backend=backend)
        assert (peer.backend, peer.control) == (backend, control)
        data = _pattern(70_001, seed=tag)
        await peer.write("buf", 100, data, tag=tag, timeout_s=10)
        await receiver.wait("buf", tag, timeout_s=5)
        assert np.array_equal(receiver.region("buf").view(100, data.nbytes), data)
    with pytest.raises(BlockingIOError):
        other.accept()  # never connected to
    other.close()
    await receiver.close()
    with pytest.raises(FileNotFoundError):
        os.stat(path)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_write_is_byte_exact_and_notice_carries_meta(
    receiver: KvReceiver, sender: KvSender, backend: str
) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    assert peer.backend == backend
    data = _pattern(1_000_003, seed=1)
    await peer.write("buf", 12345, data, tag=7, meta=b"layer=3", timeout_s=10)
    notice = await receiver.wait("buf", 7, timeout_s=5, peer_id="pe-test")
    assert (notice.meta, notice.peer_id, notice.nbytes) == (b"layer=3", "pe-test", data.nbytes)
    assert np.array_equal(receiver.region("buf").view(12345, data.nbytes), data)
    assert receiver.region("buf").view(12344, 1)[0] == 0  # nothing outside the extent


@pytest.mark.parametrize("backend", BACKENDS)
async def test_large_write(receiver: KvReceiver, sender: KvSender, backend: str) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    data = _pattern(40 << 20, seed=2)
    await peer.write("buf", 0, data, tag=1, timeout_s=30)
    await receiver.wait("buf", 1, timeout_s=5)
    assert np.array_equal(receiver.region("buf").view(0, data.nbytes), data)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_many_small_scattered_writes_one_notice(
    receiver: KvReceiver, sender: KvSender, backend: str
) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    blocks = _pattern(3000 * 1000, seed=3).reshape(3000, 1000)  # Layer-Block-like pieces
    offsets = np.random.default_rng(4).permutation(3000) * 4096  # non-contiguous, out of order
    await peer.write_many("buf", list(zip(offsets.tolist(), blocks, strict=True)), tag=2, timeout_s=30)
    notice = await receiver.wait("buf", 2, timeout_s=5)
    assert notice.nbytes == blocks.nbytes
    region = receiver.region("buf").array()
    got = np.stack([region[o : o + 1000] for o in offsets.tolist()])
    assert np.array_equal(got, blocks)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_untagged_writes_then_notify(receiver: KvReceiver, sender: KvSender, backend: str) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    for layer in range(4):
        await peer.write("buf", layer * 100, np.full(100, layer + 1, np.uint8), timeout_s=5)
    assert receiver.poll("buf", 9) is None
    await peer.notify("buf", 9, b"all layers", timeout_s=5)
    assert (await receiver.wait("buf", 9, timeout_s=5)).meta == b"all layers"
    assert receiver.region("buf").view(0, 400).reshape(4, 100)[:, 0].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_concurrent_writers_on_one_peer(receiver: KvReceiver, sender: KvSender, backend: str) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    chunks = [_pattern(256 << 10, seed=10 + i) for i in range(16)]
    await asyncio.gather(
        *(peer.write("buf", i * (256 << 10), c, tag=100 + i, timeout_s=20) for i, c in enumerate(chunks))
    )
    notices = await asyncio.gather(*(receiver.wait("buf", 100 + i, timeout_s=5) for i in range(16)))
    assert [n.tag for n in notices] == list(range(100, 116))
    assert np.array_equal(receiver.region("buf").view(0, 16 << 18), np.concatenate(chunks))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_bad_writes_are_errors_not_crashes(
    receiver: KvReceiver, sender: KvSender, backend: str
) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    size = receiver.region("buf").size_bytes
    with pytest.raises(TransportError, match="outside region") as info:
        await peer.write("buf", size - 10, np.zeros(11, np.uint8), tag=1, timeout_s=5)
    assert info.value.param == "offset"
    with pytest.raises(TransportError, match="no region named"):
        await peer.write("nope", 0, b"x", timeout_s=5)
    with pytest.raises(TransportError, match="C-contiguous"):
        await peer.write("buf", 0, np.zeros((8, 8), np.uint8)[:, ::2], timeout_s=5)
    with pytest.raises(TransportError, match="u32"):
        await peer.write("buf", 0, b"x", tag=-1, timeout_s=5)
    await peer.write("buf", 0, b"still fine", tag=3, timeout_s=5)  # the peer is still usable
    assert (await receiver.wait("buf", 3, timeout_s=5)).nbytes == 10


@pytest.mark.parametrize("backend", BACKENDS)
async def test_tag_reuse_before_consumption_is_refused(
    receiver: KvReceiver, sender: KvSender, backend: str
) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    await peer.notify("buf", 5, timeout_s=5)
    with pytest.raises(TransportError, match="already pending"):
        await peer.notify("buf", 5, timeout_s=5)
    await receiver.wait("buf", 5, timeout_s=5)
    await peer.notify("buf", 5, timeout_s=5)  # consumed: reusable


async def test_pending_notice_limit_is_overload() -> None:
    rx = KvReceiver(TransportConfig(backends=["tcp"], max_pending_notices=3))
    await rx.start()
    rx.register_region("r", 64)
    tx = KvSender(TransportConfig(backends=["tcp"]))
    try:
        peer = await tx.connect(rx.endpoint(), timeout_s=5)
        for tag in range(3):
            await peer.notify("r", tag, timeout_s=5)
        with pytest.raises(OverloadedError):
            await peer.notify("r", 3, timeout_s=5)
        rx.discard("r")
        await peer.notify("r", 3, timeout_s=5)
    finally:
        await tx.close()
        await rx.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_unregister_fails_waiters_and_stale_ids_are_refreshed(
    receiver: KvReceiver, sender: KvSender, backend: str
) -> None:
    receiver.register_region("slot", 4096)
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend)
    await peer.write("slot", 0, b"a", tag=1, timeout_s=5)
    await receiver.wait("slot", 1, timeout_s=5)
    waiter = asyncio.ensure_future(receiver.wait("slot", 2, timeout_s=30))
    await asyncio.sleep(0)
    receiver.unregister_region("slot")
    with pytest.raises(TransportError, match="unregistered"):
        await waiter
    with pytest.raises(TransportError, match="unknown region id"):
        await peer.write("slot", 0, b"b", tag=2, timeout_s=5)
    receiver.register_region("slot", 8192)  # new id; the peer looks it up again
    await peer.write("slot", 8000, b"c", tag=2, timeout_s=5)
    await receiver.wait("slot", 2, timeout_s=5)
    assert bytes(receiver.region("slot").view(8000, 1)) == b"c"


async def test_wait_deadline_and_gone_peer(
    receiver: KvReceiver, sender: KvSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DeadlineExceededError, match="buf"):
        await receiver.wait("buf", 1, timeout_s=0.05)
    peer = await sender.connect(receiver.endpoint(), timeout_s=5)
    await peer.notify("buf", 1, timeout_s=5)
    waiter = asyncio.ensure_future(receiver.wait("buf", 2, timeout_s=30, peer_id="pe-test"))
    await receiver.wait("buf", 1, timeout_s=5)
    await peer.close()
    with pytest.raises(TransportError, match="pe-test disconnected"):
        await waiter
    monkeypatch.setattr(receiver_module, "REJOIN_GRACE_S", 0.2)
    with pytest.raises(TransportError, match="pe-test is gone"):  # ... and did not come back in the grace
        await receiver.wait("buf", 3, timeout_s=30, peer_id="pe-test")
    # a new process under the same id (a restarted engine) connects within the grace: its notice arrives
    monkeypatch.setattr(receiver_module, "REJOIN_GRACE_S", 10.0)
    waiter = asyncio.ensure_future(receiver.wait("buf", 4, timeout_s=30, peer_id="pe-test"))
    again = await sender.connect(receiver.endpoint(), timeout_s=5)
    await again.notify("buf", 4, timeout_s=5)
    assert (await asyncio.wait_for(waiter, 10)).tag == 4


async def test_receiver_close_fails_senders_and_waiters(receiver: KvReceiver, sender: KvSender) -> None:
    peer = await sender.connect(receiver.endpoint(), timeout_s=5, backend="tcp")
    waiter = asyncio.ensure_future(receiver.wait("buf", 1, timeout_s=30))
    await asyncio.sleep(0)
    await receiver.close()
    with pytest.raises(TransportError, match="closed"):
        await waiter
    with pytest.raises(TransportError, match=r"lost|closed"):
        for _ in range(100):  # the first write may still fit in the kernel's buffer
            await peer.write("buf", 0, b"x" * 65536, tag=1, timeout_s=5)
    assert not peer.is_open


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the sender never saw the connection close"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_stopping_receiver_says_bye_and_its_senders_do_not_warn(
    receiver: KvReceiver, sender: KvSender, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver that stops sends BYE before closing: its senders log the close at INFO (every clean
    shutdown of a cluster used to log a lost connection as a warning); a connection closed without it (as
    a crashed receiver's is) is still a warning."""
    caplog.set_level(logging.INFO, logger="shared.transport.channel")
    peers = [await sender.connect(receiver.endpoint(), timeout_s=5, backend=backend) for _ in range(2)]
    connections = list(receiver._connections)
    assert len(connections) == 2
    connections[0].close("as a crash would")
    await _until(lambda: not all(p.is_open for p in peers))
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shared.transport.channel"]
    assert len(records) == 1 and records[0][0] == logging.WARNING and "lost" in records[0][1], records
    caplog.clear()
    (left,) = [p for p in peers if p.is_open]
    await receiver.close()
    await _until(lambda: not left.is_open)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shared.transport.channel"]
    said = f"kv sender: KV receiver {receiver.receiver_id} stopped and closed the connection"
    assert records == [(logging.INFO, said)], records

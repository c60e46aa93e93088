"""`kvpath serve storage` as a real process: flags, serving an engine client, clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.bus import Bus
from shared.errors import KvpathError, ServiceUnavailableError
from shared.kvclient import StorageClient
from shared.kvclient import storage as storage_client
from shared.natsserver import NatsServer
from shared.shm import segment_path
from tests.integration.storage.storage_harness import FP, LAYOUT, chain, write_blocks

KVPATH = str(Path(sys.executable).parent / "kvpath")


def _storage_args(nats_server: NatsServer, namespace: str, root: Path, *, node: int) -> list[str]:
    args = [KVPATH, "serve", "storage", "--node", str(node), "--root", str(root), "--buffer-bytes", "2097152"]
    return [*args, "--nats-url", nats_server.url, "--namespace", namespace, "--fsync-policy", "dir"]


async def _client(nats_server: NatsServer, namespace: str, *, node: int) -> tuple[Bus, StorageClient]:
    """An engine's bus connection and its storage client of `node` (not started)."""
    bus = Bus(nats_server.url, namespace, name="engine")
    await bus.connect()
    return bus, StorageClient(bus, node, LAYOUT, FP, staging_bytes=1 << 20)


async def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the service unlinks its buffer segment), SIGKILL if it does not end."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def test_storage_process_serves_and_stops_cleanly(
    nats_server: NatsServer, namespace: str, tmp_path: Path
) -> None:
    root, log = tmp_path / "blocks", tmp_path / "storage.log"
    args = _storage_args(nats_server, namespace, root, node=3)
    proc = await asyncio.to_thread(_spawn, args, log)
    bus, client = await _client(nats_server, namespace, node=3)
    try:
        await _wait_answering(client, proc, log)
        info = await client.info(timeout_s=1.0)
        assert info.node == 3 and info.buffer_bytes == 2097152 and segment_path(info.buffer_name).exists()
        await client.start()
        hashes, parents = chain(3)
        data = await write_blocks(client, hashes, parents)
        assert len(list(root.rglob("*.blk"))) == 3
        async with await client.read("r", hashes, deadline_s=5.0) as lease:
            assert np.array_equal(lease.views, data)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
        assert not segment_path(info.buffer_name).exists()  # the owner unlinked its buffer
    finally:
        await client.close()
        await bus.close()
        await _stop(proc)


async def test_a_write_sent_while_the_storage_service_restarts_lands_when_it_is_back(
    nats_server: NatsServer, namespace: str, tmp_path: Path
) -> None:
    """The storage service is gone (killed; `kvpath up` or Kubernetes starts it again) when an engine's write
    goes out: the write is asked again until a new process answers, and the blocks are stored. Before, it
    failed at once ("no service answers") and the blocks were never persisted, so later turns recomputed
    them."""
    root, log = tmp_path / "blocks", tmp_path / "storage.log"
    args = _storage_args(nats_server, namespace, root, node=4)
    proc = await asyncio.to_thread(_spawn, args, log)
    bus, client = await _client(nats_server, namespace, node=4)
    try:
        await _wait_answering(client, proc, log)
        await client.start()
        proc.kill()
        await asyncio.to_thread(proc.wait, 10)
        hashes, parents = chain(2)
        write = asyncio.create_task(write_blocks(client, hashes, parents))  # sent to nobody
        proc = await asyncio.to_thread(_spawn, args, log)  # the restart (about a second to answer)
        data = await asyncio.wait_for(write, 10)
        assert len(list(root.rglob("*.blk"))) == 2
        async with await client.read("r", hashes, deadline_s=5.0) as lease:
            assert np.array_equal(lease.views, data)
    finally:
        await client.close()
        await bus.close()
        await _stop(proc)


async def _wait_answering(client: StorageClient, proc: subprocess.Popen[bytes], log: Path) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:  # ready = answering on its control subject
        try:
            await client.info(timeout_s=1.0)
            return
        except KvpathError:
            assert proc.poll() is None, log.read_text()[-2000:]  # noqa: ASYNC240 (read on failure only)
            assert loop.time() < deadline, "storage did not become ready"
            await asyncio.sleep(0.05)


async def test_writes_to_a_node_down_for_good_fail_at_once_after_the_restart_grace(
    nats_server: NatsServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No storage service ever answers: writes wait for one only RESTART_GRACE_S (here 0.3 s), then fail at
    once, so a node down for good does not hold every finishing request for its write's timeout."""
    monkeypatch.setattr(storage_client, "RESTART_GRACE_S", 0.3)
    bus, client = await _client(nats_server, namespace, node=5)
    try:
        await client.start()
        loop = asyncio.get_running_loop()
        waits = []
        for _ in range(2):
            staged = client.stage(1)
            started = loop.time()
            with pytest.raises(ServiceUnavailableError):
                await client.write(staged, *chain(1), timeout_s=3.0)
            waits.append(loop.time() - started)
        assert 0.3 <= waits[0] < 1.5 and waits[1] < 0.2, waits
        assert client.stage(1).num_blocks == 1  # the failed writes gave their staging space back
    finally:
        await client.close()
        await bus.close()

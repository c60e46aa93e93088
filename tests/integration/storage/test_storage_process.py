"""`kvpath serve storage` as a real process: flags, serving an engine client, clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from shared.bus import Bus
from shared.errors import KvpathError
from shared.kvclient import StorageClient
from shared.natsserver import NatsServer
from shared.shm import segment_path
from tests.integration.storage.storage_harness import FP, LAYOUT, chain, write_blocks

KVPATH = str(Path(sys.executable).parent / "kvpath")


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def test_storage_process_serves_and_stops_cleanly(
    nats_server: NatsServer, namespace: str, tmp_path: Path
) -> None:
    root, log = tmp_path / "blocks", tmp_path / "storage.log"
    args = [KVPATH, "serve", "storage", "--node", "3", "--root", str(root), "--buffer-bytes", "2097152"]
    args += ["--nats-url", nats_server.url, "--namespace", namespace, "--fsync-policy", "dir"]
    proc = await asyncio.to_thread(_spawn, args, log)
    bus = Bus(nats_server.url, namespace, name="engine")
    await bus.connect()
    client = StorageClient(bus, 3, LAYOUT, FP, staging_bytes=1 << 20)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:  # ready = answering on its control subject
            try:
                info = await client.info(timeout_s=1.0)
                break
            except KvpathError:
                assert proc.poll() is None, log.read_text()[-2000:]
                assert loop.time() < deadline, "storage did not become ready"
                await asyncio.sleep(0.05)
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
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)

"""The index keeps following the KV-events stream across a NATS crash and restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.index.config import IndexConfig
from services.index.service import IndexService
from shared.bus import Bus
from shared.errors import KvpathError
from shared.kvclient import IndexClient, KvEventPublisher
from shared.natsserver import NatsServer


async def _publish_with_retry(pub: KvEventPublisher, hashes: list[int], timeout_s: float) -> int:
    """Publish once NATS is back (the publisher's bus reconnects on its own)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            return await pub.stored("store", hashes)
        except KvpathError:
            assert loop.time() < deadline, "could not publish after the NATS restart"
            await asyncio.sleep(0.1)


async def test_index_follows_the_stream_across_a_nats_restart(tmp_path: Path, namespace: str) -> None:
    store_dir = tmp_path / "nats"
    store_dir.mkdir()
    server = NatsServer(store_dir=str(store_dir), log_path=str(tmp_path / "nats.log")).start()
    config = IndexConfig(nats_url=server.url, namespace=namespace, fetch_wait_s=0.1, request_timeout_s=2.0)
    index = IndexService(config)
    await index.start()
    bus = Bus(server.url, namespace, name="publisher", request_timeout_s=2.0)
    await bus.connect()
    pub, client = KvEventPublisher(bus, "storage-0"), IndexClient(bus)
    try:
        await pub.start()
        await client.wait_applied(await pub.stored("store", [1, 2, 3]), timeout_s=5.0)
        server.kill()  # crash; the stream is on disk (file storage), the index's consumer is gone
        server = NatsServer(port=server.port, store_dir=str(store_dir), log_path=str(tmp_path / "nats.log"))
        server.start()
        seq = await _publish_with_retry(pub, [4, 5], timeout_s=20.0)
        await client.wait_applied(seq, timeout_s=20.0)
        assert (await client.match([1, 2, 3])).num_hit_blocks == 3
        assert (await client.match([4, 5])).num_hit_blocks == 2
    finally:
        await bus.close()
        await index.stop()
        server.stop()

"""Helpers of the storage integration tests: in-process services, real clients, the event stream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
import numpy as np

from services.storage.config import StorageConfig
from services.storage.service import StorageService
from shared.blocks import BlockLayout
from shared.bus import Bus
from shared.hashing import block_hashes, block_parents, model_fingerprint
from shared.kvclient import StorageClient
from shared.natsserver import NatsServer
from shared.protocol import decode
from shared.protocol.kv import KV_EVENT_TYPES, KvEvent

LAYOUT = BlockLayout(num_layers=2, block_size=16, bytes_per_token_layer=512)  # 16 KiB Full Blocks
FP = model_fingerprint("test", dtype="uint8", block_size=16, num_layers=2, bytes_per_token_layer=512)


@dataclass
class Node:
    service: StorageService
    client: StorageClient


class StorageCluster:
    """Storage services and clients of one test; everything is stopped at teardown."""

    def __init__(self, server: NatsServer, namespace: str, tmp_path: Path) -> None:
        self.server, self.namespace, self.tmp_path = server, namespace, tmp_path
        self.services: list[StorageService] = []
        self.clients: list[StorageClient] = []
        self.buses: list[Bus] = []

    async def bus(self, name: str) -> Bus:
        bus = Bus(self.server.url, self.namespace, name=name, request_timeout_s=5.0)
        await bus.connect()
        self.buses.append(bus)
        return bus

    async def start(
        self, node: int = 0, *, layout: BlockLayout = LAYOUT, fp: str = FP, **overrides: Any
    ) -> Node:
        fields: dict[str, Any] = {
            "nats_url": self.server.url,
            "namespace": self.namespace,
            "node": node,
            "root": str(self.tmp_path / "root"),
            "buffer_bytes": 4 * 1024 * 1024,
            "load_report_interval_s": 0.05,
            "drain_timeout_s": 2.0,
            **overrides,
        }
        service = StorageService(StorageConfig(**fields))
        await service.start()
        self.services.append(service)
        client = await self.client(node, layout=layout, fp=fp)
        return Node(service, client)

    async def client(self, node: int, *, layout: BlockLayout = LAYOUT, fp: str = FP) -> StorageClient:
        client = StorageClient(
            await self.bus(f"engine-{len(self.clients)}"), node, layout, fp, staging_bytes=8 << 20
        )
        await client.start()
        self.clients.append(client)
        return client

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        for service in self.services:
            await service.stop()
        for bus in self.buses:
            await bus.close()


def chain(num_blocks: int, seed: int = 0, fp: str = FP) -> tuple[list[int], list[int]]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, size=num_blocks * LAYOUT.block_size)
    hashes = block_hashes(tokens, LAYOUT.block_size, fp)
    return hashes, block_parents(hashes, fp)


async def write_blocks(
    client: StorageClient, hashes: list[int], parents: list[int], seed: int = 0
) -> np.ndarray:
    """Stage random blocks, persist them; return a copy of what was written."""
    staged = client.stage(len(hashes))
    staged.views[:] = np.random.default_rng(seed).integers(0, 256, size=staged.views.shape, dtype=np.uint8)
    data = staged.views.copy()
    await client.write(staged, hashes, parents)
    return data


async def stream_events(bus: Bus) -> list[KvEvent]:
    """Every KV event currently in the stream, in order."""
    sub = await bus.js.pull_subscribe(bus.subjects.kv_events_all, stream=bus.subjects.kv_events_stream)
    events: list[KvEvent] = []
    while True:
        try:
            msgs = await sub.fetch(256, timeout=0.3)
        except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either when nothing is left
            break
        events.extend(decode(m.data, KV_EVENT_TYPES) for m in msgs)
        for m in msgs:
            await m.ack()
    await sub.unsubscribe()
    return events


async def wait_for(predicate: Callable[[], Awaitable[bool] | bool], timeout_s: float, what: str) -> None:
    """Poll a condition until it holds; fail with `what` after the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)

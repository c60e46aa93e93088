"""Fixtures of the integration tests: service processes started one by one against a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from shared.bus import Bus
from shared.natsserver import NatsServer
from tests.cluster import Stack


@pytest.fixture
async def stack(tmp_path: Path, nats_server: NatsServer, namespace: str) -> AsyncIterator[tuple[Stack, Bus]]:
    s = Stack(tmp_path, nats_server, namespace)
    bus = Bus(nats_server.url, namespace, name="test")
    await bus.connect()
    yield s, bus
    await bus.close()
    s.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client for the tests' requests (a module may define its own)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session

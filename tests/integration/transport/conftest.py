"""Fixtures of the transport tests: a started receiver with one region, a sender, both closed after."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.transport import KvReceiver, KvSender, TransportConfig

REGION_BYTES = 48 << 20


@pytest.fixture
async def receiver() -> AsyncIterator[KvReceiver]:
    rx = KvReceiver(TransportConfig(backends=["shm", "tcp"]), receiver_id="rx-test")
    await rx.start()
    rx.register_region("buf", REGION_BYTES)
    yield rx
    await rx.close()


@pytest.fixture
async def sender() -> AsyncIterator[KvSender]:
    tx = KvSender(TransportConfig(backends=["shm", "tcp"]), sender_id="pe-test")
    yield tx
    await tx.close()

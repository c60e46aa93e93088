"""The index service against a real nats-server: replay after a kill, snapshot + purge, idempotency."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from services.index.config import IndexConfig
from services.index.service import IndexService
from shared.bus import Bus
from shared.errors import InvalidRequestError, KvpathError, ServiceUnavailableError
from shared.kvclient import IndexClient, KvEventPublisher, MatchResult
from shared.natsserver import NatsServer
from shared.protocol import ErrorReply, decode, encode
from shared.protocol.kv import BlockStored, IndexMatchRequest

KVPATH = str(Path(sys.executable).parent / "kvpath")


@pytest.fixture
async def bus(nats_server: NatsServer, namespace: str) -> AsyncIterator[Bus]:
    b = Bus(nats_server.url, namespace, name="test-client", request_timeout_s=3.0)
    await b.connect()
    yield b
    await b.close()


def _chains(seed: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 2**64 - 1, size=length, dtype=np.uint64, endpoint=True).tolist() for _ in range(n)
    ]


async def _feed_events(bus: Bus, chains: Sequence[list[int]], *, source_prefix: str = "src") -> int:
    """Stores, an engine tier, removals and a duplicate-prone mix; return the last stream seq."""
    storage = KvEventPublisher(bus, f"{source_prefix}-storage")
    engine = KvEventPublisher(bus, f"{source_prefix}-engine")
    await storage.start()
    seq = 0
    for i, hashes in enumerate(chains):
        seq = await storage.stored("store", hashes)
        if i % 2 == 0:
            seq = await engine.stored("hbm:engine-7", hashes[: len(hashes) // 2])
        if i % 3 == 0:
            seq = await storage.removed(
                "store", hashes[len(hashes) // 4 : len(hashes) // 4 + 1], reason="evicted"
            )
    return seq


async def _matches(client: IndexClient, chains: Sequence[list[int]]) -> list[MatchResult]:
    return [await client.match(c) for c in chains]


class IndexProcess:
    """`kvpath serve index` as a real subprocess."""

    def __init__(self, server: NatsServer, namespace: str, tmp_path: Path, *extra: str) -> None:
        self.args = [KVPATH, "serve", "index", "--nats-url", server.url, "--namespace", namespace]
        self.args += ["--data-dir", str(tmp_path / "index-data"), "--fetch-wait-s", "0.1", *extra]
        self.log = tmp_path / "index.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as log:
            return subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def start(self, client: IndexClient, timeout_s: float = 30.0) -> None:
        self.proc = await asyncio.to_thread(self._spawn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:  # ready = answering on the bus (it subscribes only after replaying the stream)
            try:
                await client.stats(timeout_s=1.0)
                return
            except KvpathError:
                assert self.proc.poll() is None, f"index exited: {self.log.read_text()[-2000:]}"
                assert loop.time() < deadline, "index did not become ready"
                await asyncio.sleep(0.05)

    async def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(self.proc.wait, 10)

    async def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            await asyncio.to_thread(self.proc.wait, 15)


async def test_killed_index_answers_the_same_after_replay(
    nats_server: NatsServer, namespace: str, bus: Bus, tmp_path: Path
) -> None:
    client = IndexClient(bus)
    chains = _chains(1, 12, 64)
    await _feed_events(bus, chains)
    index = IndexProcess(nats_server, namespace, tmp_path, "--no-snapshot-on-stop")
    try:
        await index.start(client)
        before = await _matches(client, chains)
        # chain 0: all 64 in store but block 16 removed, the first 32 in engine-7's HBM
        assert before[0] == MatchResult(64, {"store": 16, "hbm": 32}, {"store": 16, "hbm:engine-7": 32})
        assert before[1].per_location == {"store": 64}
        await index.kill()
        with pytest.raises(ServiceUnavailableError):
            await client.match(chains[0])
        # events that arrive while the index is down are not lost either
        late = _chains(2, 2, 8)
        seq = await _feed_events(bus, late, source_prefix="late")
        await index.start(client)
        await client.wait_applied(seq, timeout_s=10.0)
        assert await _matches(client, chains) == before
        assert [m.per_tier["store"] for m in await _matches(client, late)] == [2, 8]
    finally:
        await index.terminate()


async def test_snapshot_and_purge_then_restart(
    nats_server: NatsServer, namespace: str, bus: Bus, tmp_path: Path
) -> None:
    client = IndexClient(bus)
    chains = _chains(3, 20, 32)
    index = IndexProcess(nats_server, namespace, tmp_path, "--snapshot-every-events", "10")
    try:
        await index.start(client)
        seq = await _feed_events(bus, chains)
        stats = await client.wait_applied(seq, timeout_s=10.0)
        before = await _matches(client, chains)

        async def purged() -> bool:
            info = await bus.js.stream_info(bus.subjects.kv_events_stream)
            return int(info.state.first_seq) > 10

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await purged():
            assert loop.time() < deadline, "stream was not purged after a snapshot"
            await asyncio.sleep(0.05)
        stats = await client.stats()
        assert stats.snapshot_stream_seq >= 10 and (tmp_path / "index-data" / "index-snapshot.npz").exists()
        await index.kill()
        await index.start(client)
        assert await _matches(client, chains) == before
        # the restarted index keeps applying new events on top of the snapshot
        extra = _chains(4, 1, 4)
        await client.wait_applied(await _feed_events(bus, extra, source_prefix="x"), timeout_s=10.0)
        assert (await client.match(extra[0])).num_hit_blocks == 4
        # a graceful stop snapshots, and a start from that snapshot needs no replay at all
        await index.terminate()
        await index.start(client)
        assert await _matches(client, chains) == before
    finally:
        await index.terminate()


async def test_a_quiet_stream_is_snapshotted_and_purged_on_time(
    nats_server: NatsServer, namespace: str, bus: Bus, tmp_path: Path
) -> None:
    """Few events never reach snapshot_every_events; the time trigger still keeps the stream short (an
    unpurged stream grows nats-server's memory without bound)."""
    config = IndexConfig(
        nats_url=nats_server.url,
        namespace=namespace,
        fetch_wait_s=0.1,
        data_dir=str(tmp_path / "index-data"),
        snapshot_every_events=1_000_000,
        snapshot_every_s=0.5,
    )
    service = IndexService(config)
    await service.start()
    try:
        client = IndexClient(bus)
        seq = await _feed_events(bus, _chains(5, 3, 8))
        await client.wait_applied(seq, timeout_s=10.0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while int((await bus.js.stream_info(bus.subjects.kv_events_stream)).state.first_seq) <= seq:
            assert loop.time() < deadline, "the stream was not purged by the time trigger"
            await asyncio.sleep(0.05)
        assert (await client.stats()).snapshot_stream_seq == seq
    finally:
        await service.stop()


@pytest.fixture
async def index_service(nats_server: NatsServer, namespace: str) -> AsyncIterator[IndexService]:
    service = IndexService(IndexConfig(nats_url=nats_server.url, namespace=namespace, fetch_wait_s=0.1))
    await service.start()
    yield service
    await service.stop()


async def test_duplicates_replays_and_malformed_events(index_service: IndexService, bus: Bus) -> None:
    client = IndexClient(bus)
    subject = bus.subjects.kv_events("dup")
    event = BlockStored(source="dup", epoch=1, seq=1, location="store", block_hashes=[1, 2, 3])
    removal = BlockStored(source="dup", epoch=1, seq=2, location="hbm:e", block_hashes=[1])
    for msg in (event, removal, event, removal):  # no Nats-Msg-Id: the stream keeps all four
        await bus.js.publish(subject, encode(msg))
    await bus.js.publish(subject, b"\x00 not an event")
    await bus.js.publish(subject, b'{"kind": "kv_block_stored", "v": 1, "source": "dup"}')
    bad_hash = encode(BlockStored(source="bad", epoch=1, seq=1, location="store", block_hashes=[5]))
    last = await bus.js.publish(subject, bad_hash.replace(b"[5]", b"[-5]"))
    stats = await client.wait_applied(last.seq, timeout_s=10.0)
    assert (stats.num_events_applied, stats.num_events_ignored) == (2, 2)
    assert index_service.num_malformed_events == 3
    assert await client.match([1, 2, 3, 4]) == MatchResult(
        3, {"store": 3, "hbm": 1}, {"store": 3, "hbm:e": 1}
    )


async def test_match_requests_are_validated(index_service: IndexService, bus: Bus) -> None:
    client = IndexClient(bus)
    assert (await client.match([])).num_hit_blocks == 0
    raw = await bus.nc.request(bus.subjects.index_match, b'{"kind": "index_match", "v": 1}', timeout=2)
    assert decode(raw.data, ErrorReply).code == "bad_message"
    raw = await bus.nc.request(
        bus.subjects.index_match, b'{"kind":"index_match","v":1,"block_hashes":["x"]}', timeout=2
    )
    assert decode(raw.data, ErrorReply).code == "bad_message"
    with pytest.raises(InvalidRequestError, match="64-bit"):
        await bus.request(bus.subjects.index_match, IndexMatchRequest(block_hashes=[-1]), ErrorReply)
    index_service.config.max_match_blocks = 4
    with pytest.raises(InvalidRequestError, match="at most 4"):
        await client.match([1, 2, 3, 4, 5])
    assert (await client.match([7])).num_hit_blocks == 0  # still serving

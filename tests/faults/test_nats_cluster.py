"""`kvpath up --nats-cluster 3`: three nats-servers as one cluster, the KV-events stream and the registry
replicated 3 ways. SIGKILL one server: requests keep being served, KV events keep reaching the index (a new
prompt's second turn hits), the supervisor restarts the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from shared.bus import Bus
from shared.kvclient import KvEventPublisher
from shared.natsserver import NatsCluster
from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
RECOVER_S = 60.0


def _complete(up: UpProcess, prompt: list[int]) -> dict[str, Any] | None:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"{up.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def _cached(up: UpProcess, prompt: list[int]) -> int:
    """Cached tokens of the prompt's next request, once a request succeeds (within the deadline)."""
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        out = _complete(up, prompt)
        if out is not None:
            return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.3)
    raise AssertionError("no request succeeded in time")


def _hits_on_second_turn(up: UpProcess, salt: int) -> bool:
    prompt = [(i * 7 + salt) % 250 + 3 for i in range(200)]  # 3 full blocks of 64
    _cached(up, prompt)
    deadline = time.monotonic() + RECOVER_S  # persisting and indexing happen after the first reply
    while time.monotonic() < deadline:
        if _cached(up, prompt) >= 128:
            return True
        time.sleep(0.3)
    return False


def test_losing_one_of_three_nats_servers_loses_nothing(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, "--nats-cluster", "3", "--kv-root", str(tmp_path / "kv"))
    try:
        assert len(up.info["nats_url"].split(",")) == 3
        assert _hits_on_second_turn(up, salt=1)
        state = up.supervisor_state()
        assert {"nats-0", "nats-1", "nats-2"} <= state.keys()
        os.kill(state["nats-1"]["pid"], signal.SIGKILL)
        assert _hits_on_second_turn(up, salt=2)  # served, persisted and indexed with one server down
        deadline = time.monotonic() + RECOVER_S
        while up.supervisor_state()["nats-1"]["restarts"] != 1:
            assert time.monotonic() < deadline, "nats-1 was not restarted"
            time.sleep(0.2)
        assert _hits_on_second_turn(up, salt=1)  # the first prompt's blocks survived in the index
    finally:
        assert up.stop() == 0, up.log()


async def test_kv_events_sent_while_their_streams_leader_dies_all_reach_the_stream(tmp_path: Path) -> None:
    """The server leading the KV-events stream (3 replicas) is SIGKILLed while a source publishes: the
    stream answers "no response" while the other two elect a leader, and each event is sent again until
    stored; before, every event of those seconds failed and was lost to the index (16 hbm and 13 storage
    events in one agent-mix probe). The publisher is on a surviving server."""
    cluster = NatsCluster(3, store_dir=str(tmp_path / "js"), log_dir=str(tmp_path))
    await asyncio.to_thread(cluster.start)  # it runs its own event loop while JetStream comes up
    try:
        info_bus = Bus(cluster.url, "t" + uuid.uuid4().hex[:10], name="probe", jetstream_replicas=3)
        await info_bus.connect()
        publisher = KvEventPublisher(info_bus, "storage-0")
        await publisher.start()
        await publisher.stored("store", [1])
        stream = await info_bus.js.stream_info(info_bus.subjects.kv_events_stream)
        leader = int(str(stream.cluster.leader)[1:])  # servers are named n0, n1, n2
        survivor = cluster.servers[(leader + 1) % 3]
        bus = Bus(survivor.url, info_bus.subjects.namespace, name="source", jetstream_replicas=3)
        await bus.connect()
        await info_bus.close()
        publisher = KvEventPublisher(bus, "storage-1")
        cluster.servers[leader].kill()
        seqs = [await publisher.stored("store", [100 + i]) for i in range(40)]
        assert len(set(seqs)) == 40
        stream = await bus.js.stream_info(bus.subjects.kv_events_stream)
        assert stream.state.messages == 41
        await bus.close()
    finally:
        cluster.stop()

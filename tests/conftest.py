"""Shared fixtures: a real nats-server on a free port, a unique namespace per test."""

from __future__ import annotations

import collections
import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest

from services.up.process import UpProcess
from shared.natsserver import NatsServer
from tests.reference import SmolLM2Reference

# Every service these tests start runs float32 (KVPATH_<FIELD> reaches every config with a `dtype`): they
# assert identical greedy tokens across KV paths, which float32 keeps and bfloat16 does not (a GEMM over 2
# rows rounds unlike one over 450). CPU engines default to float32 anyway; on a CUDA host this keeps the
# paths' checks meaningful, and tests/gpu checks bfloat16 itself.
os.environ.setdefault("KVPATH_DTYPE", "float32")
# ... and each engine runs torch on one thread: tests start up to four engines at once, and on a machine of
# few cores torch's default (a spinning thread per core in every engine) made them fight for the cores: a
# SmolLM2 prefill/decode pair took 14 s of CPU each to start instead of 7, and 19 s of wall time instead of 10
os.environ.setdefault("KVPATH_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """One nats-server (JetStream on) for the whole session; tests isolate themselves by namespace."""
    server = NatsServer(log_path=str(tmp_path_factory.mktemp("nats") / "nats.log"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def private_nats(tmp_path) -> Iterator[NatsServer]:
    """A nats-server of this test's own, for tests that kill or restart it."""
    server = NatsServer(log_path=str(tmp_path / "nats.log"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def smollm2_reference() -> SmolLM2Reference:
    """transformers loading SmolLM2's GGUF file with its own loader (about 8 s, once per session): the
    reference kvpath's tokens and logprobs are checked against, in-process and through the API."""
    return SmolLM2Reference()


# Clusters that several modules share: each is started by the first test that uses it and stopped right
# after the last one (counted once the session's tests are collected), not idle to the end of the session
# (an idle cluster takes 2-4 % of a core: its load reports, heartbeats and the index's event feed).
SHARED_CLUSTERS = ("smollm2_cluster", "cold_cluster", "kv_store_cluster")
_running: dict[str, UpProcess] = {}
_users: collections.Counter[str] = collections.Counter()  # shared cluster -> tests left that use it


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        _users.update(name for name in SHARED_CLUSTERS if name in getattr(item, "fixturenames", ()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    finally:
        for name in SHARED_CLUSTERS:
            if name in getattr(item, "fixturenames", ()):
                _users[name] -= 1
                if _users[name] <= 0 and name in _running:
                    up = _running.pop(name)
                    assert up.stop() == 0, up.log()


@contextlib.contextmanager
def shared_cluster(name: str, up: UpProcess) -> Iterator[UpProcess]:
    _running[name] = up
    try:
        yield up
    finally:
        _running.pop(name, None)
        assert up.stop() == 0, up.log()  # stopped already when its last user ended (stop is idempotent)


@pytest.fixture(scope="session")
def smollm2_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`kvpath up` as `make run` starts it (SmolLM2, one colocated engine, a KV store), for the README's
    examples and SmolLM2's colocated serving test, each in sessions and prompts of its own (8 s a start)."""
    with shared_cluster("smollm2_cluster", UpProcess(tmp_path_factory.mktemp("smollm2"), model=None)) as up:
        yield up


@pytest.fixture(scope="session")
def cold_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`kvpath up --no-kv-store` on the tiny model: every turn recomputed, the reference that tests of KV
    paths compare tokens with, and a plain OpenAI endpoint (about 4 s a start). It stores no KV, so what one
    test sends changes nothing that another asserts. Its router refuses max_tokens above 512 (the API tests
    check that limit); every user asks for an explicit max_tokens of at most 512, which it leaves as is."""
    args = ("--no-kv-store", "--router-arg=--max-tokens-limit 512")
    with shared_cluster("cold_cluster", UpProcess(tmp_path_factory.mktemp("cold"), *args)) as up:
        yield up


@pytest.fixture(scope="session")
def kv_store_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """`kvpath up --kv-root DIR` on the tiny model (one colocated engine, storage, index), for the load
    generator's replays and the KV-reuse tests. Each of them stores prompts of its own (fresh content salts,
    seeded random tokens), so the blocks another test left in the store never match what one asserts."""
    tmp = tmp_path_factory.mktemp("kv")
    with shared_cluster("kv_store_cluster", UpProcess(tmp, "--kv-root", str(tmp / "store"))) as up:
        up.kv_root = tmp / "store"
        yield up

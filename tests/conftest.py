"""Shared fixtures: a real nats-server on a free port, a unique namespace per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from shared.natsserver import NatsServer
from tests.reference import SmolLM2Reference

# Every service these tests start runs float32 (KVPATH_<FIELD> reaches every config with a `dtype`): they
# assert identical greedy tokens across KV paths, which float32 keeps and bfloat16 does not (a GEMM over 2
# rows rounds unlike one over 450). CPU engines default to float32 anyway; on a CUDA host this keeps the
# paths' checks meaningful, and tests/gpu checks bfloat16 itself.
os.environ.setdefault("KVPATH_DTYPE", "float32")


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
    """transformers loading SmolLM2's GGUF file with its own loader (about 10 s, once per session): the
    reference kvpath's tokens and logprobs are checked against, in-process and through the API."""
    return SmolLM2Reference()

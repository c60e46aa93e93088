"""Backend choice per peer pair (same host -> shm; rdma only when both have it; else tcp) and the
endpoint descriptor's validation."""

from __future__ import annotations

import uuid

import pytest

from shared.errors import TransportError
from shared.protocol.transfer import KvEndpoint
from shared.shm import ShmSegment
from shared.transport.endpoint import LocalCaps, candidate_backends, host_id, parse_endpoint, probe_shm
from shared.transport.endpoint import select_backend as select


def _remote(host: str = "h1", backends: tuple[str, ...] = ("shm", "rdma", "tcp"), **kw: str) -> KvEndpoint:
    return KvEndpoint(
        receiver_id="rx", host_id=host, address="127.0.0.1", port=1, backends=list(backends), **kw
    )


def test_same_host_prefers_shm() -> None:
    assert select(LocalCaps("h1", ("shm", "rdma", "tcp")), _remote("h1")) == "shm"
    assert select(LocalCaps("h1", ("shm", "tcp")), _remote("h1", ("shm", "tcp"))) == "shm"


def test_different_hosts_never_use_shm() -> None:
    assert select(LocalCaps("h2", ("shm", "tcp")), _remote("h1", ("shm", "tcp"))) == "tcp"
    assert candidate_backends(LocalCaps("h2", ("shm", "tcp")), _remote("h1")) == ["tcp"]


def test_rdma_only_when_both_ends_have_it() -> None:
    assert select(LocalCaps("h2", ("shm", "rdma", "tcp")), _remote("h1")) == "rdma"
    assert select(LocalCaps("h2", ("shm", "tcp")), _remote("h1")) == "tcp"  # no local device
    assert select(LocalCaps("h2", ("rdma", "tcp")), _remote("h1", ("shm", "tcp"))) == "tcp"  # none remote
    # same host but the receiver does not offer shm: rdma loopback beats tcp
    assert select(LocalCaps("h1", ("shm", "rdma", "tcp")), _remote("h1", ("rdma", "tcp"))) == "rdma"


def test_forced_backend_must_be_usable() -> None:
    local = LocalCaps("h1", ("shm", "tcp"))
    assert select(local, _remote("h1"), forced="tcp") == "tcp"
    with pytest.raises(TransportError, match="not usable") as info:
        select(local, _remote("h1"), forced="rdma")
    assert info.value.param == "backend"
    with pytest.raises(TransportError, match="not usable"):
        select(LocalCaps("h2", ("shm", "tcp")), _remote("h1"), forced="shm")


def test_no_common_backend() -> None:
    with pytest.raises(TransportError, match="no common backend"):
        select(LocalCaps("h1", ("tcp",)), _remote("h2", ("shm", "rdma")))


def test_parse_endpoint_validates() -> None:
    good = _remote().to_dict()
    assert parse_endpoint(good).receiver_id == "rx"
    with pytest.raises(TransportError, match="bad KV endpoint") as info:
        parse_endpoint({**good, "port": "80"})
    assert info.value.param == "endpoint"
    with pytest.raises(TransportError, match="bad KV endpoint"):
        parse_endpoint({"kind": "service_info", "v": 1})
    with pytest.raises(TransportError, match="protocol 99"):
        parse_endpoint({**good, "protocol": 99})


def test_host_id_is_stable_and_names_this_host() -> None:
    assert host_id() == host_id()
    assert len(host_id().split("/")) == 3


def test_shm_probe_needs_the_right_token() -> None:
    name = "kvpath-test-probe-" + uuid.uuid4().hex[:8]
    with ShmSegment.create(name, 64) as segment:
        segment.buf[:6] = b"token1"
        assert probe_shm(_remote(shm_probe=name, shm_token="token1"))
        assert not probe_shm(_remote(shm_probe=name, shm_token="token2"))
    assert not probe_shm(_remote(shm_probe=name, shm_token="token1"))  # gone
    assert not probe_shm(_remote())

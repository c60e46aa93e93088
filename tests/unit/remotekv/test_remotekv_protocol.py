"""The remote KV store's subjects, messages and configs (store and engine side)."""

from __future__ import annotations

from typing import Any

import pytest

from services.engine.config import EngineConfig
from services.remotekv.config import RemoteKvConfig
from shared.config import build_config
from shared.errors import ConfigError, ProtocolError
from shared.protocol import Subjects, decode, encode
from shared.protocol.kv import RemoteKvGet, RemoteKvGetReply, RemoteKvPutReply, RemoteKvTarget


def test_subjects_name_one_store_and_a_known_op() -> None:
    subjects = Subjects("ns")
    assert subjects.remotekv("remotekv-0", "get") == "kvpath.ns.remotekv.remotekv-0.get"
    with pytest.raises(ValueError):
        subjects.remotekv("remotekv-0", "delete")
    with pytest.raises(ValueError):
        subjects.remotekv("a.*", "get")  # never a wildcard


def test_messages_round_trip_and_reject_bad_fields() -> None:
    target = RemoteKvTarget(engine_id="e", endpoint={"kind": "kv_endpoint"}, region="r", offsets=[0, 4096])
    get = RemoteKvGet(
        request_id="x",
        fingerprint="fp",
        chunk_tokens=256,
        chunk_bytes=4096,
        keys=[(1 << 64) - 1, 0],
        target=target,
    )
    assert decode(encode(get), RemoteKvGet) == get
    reply = RemoteKvPutReply(epoch=1, put_id=2, offsets=[-1, 0], outcomes=["full", "ok"])
    assert decode(encode(reply), RemoteKvPutReply) == reply
    assert decode(encode(RemoteKvGetReply(epoch=1, num_hit_chunks=0)), RemoteKvGetReply).exists == []
    bad = encode(get).replace(b'"offsets":[0,4096]', b'"offsets":["0"]')
    with pytest.raises(ProtocolError, match="offsets"):
        decode(bad, RemoteKvGet)


def engine(**fields: Any) -> EngineConfig:
    return build_config(EngineConfig, section="engine", env={}, overrides=fields)


def test_engine_config_for_the_remote_tier() -> None:
    cfg = engine(kv_remote="remotekv-0")
    assert (cfg.remote_chunk_tokens, cfg.remote_cache_bytes) == (256, 256 << 20)
    for fields, name in [
        ({"role": "prefill"}, "kv_remote"),
        ({"remote_chunk_tokens": 100}, "remote_chunk_tokens"),
        ({"remote_cache_bytes": 0}, "remote_cache_bytes"),
        ({"remote_timeout_s": 0}, "remote_timeout_s"),
        ({"load_kv": False, "persist_kv": False}, "kv_remote"),
    ]:
        with pytest.raises(ConfigError) as err:
            engine(kv_remote="remotekv-0", **fields)
        assert err.value.param == name
    assert engine(remote_chunk_tokens=100).kv_remote == ""  # unchecked while no store is named


def test_store_config_checks() -> None:
    assert build_config(RemoteKvConfig, section="remotekv", env={}).chunk_tokens == 256
    with pytest.raises(ConfigError):
        build_config(RemoteKvConfig, section="remotekv", env={}, overrides={"kv_backends": "udp"})
    with pytest.raises(ConfigError):
        build_config(RemoteKvConfig, section="remotekv", env={}, overrides={"capacity_bytes": 10})

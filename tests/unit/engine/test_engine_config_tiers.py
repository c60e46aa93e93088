"""Which KV tiers an engine that moves the query may combine: the pool yes, the remote store no."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from shared.errors import ConfigError


def test_move_the_query_combines_with_the_pool_tier() -> None:
    EngineConfig(model="tiny", move_query=True, kv_pool="pool-0", hold_bytes=1 << 20).validate()


def test_move_the_query_refuses_the_remote_store_tier() -> None:
    config = EngineConfig(model="tiny", move_query=True, kv_remote="remote-0")
    with pytest.raises(ConfigError, match="not with the remote store tier"):
        config.validate()

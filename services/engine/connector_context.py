"""What every connector that moves KV between engines is built from (`PrefillConnector`, `DecodeConnector`,
`SessionConnector`): one per engine, made by `service.build_connector`, never changed afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.node_storage import NodeStorage
from services.engine.peers import PeerPool
from shared.bus import Bus
from shared.transport import KvReceiver


@dataclass(frozen=True, slots=True)
class ConnectorContext:
    bus: Bus
    runner: Any  # the model runtime: its paged cache (`kv`) and spec
    engine_id: str
    node: int  # the storage node this engine reads and persists through
    block_size: int
    receiver: KvReceiver  # this engine's data-plane regions (buffers peers write into)
    peers: PeerPool  # connections to other engines' regions
    transfer_timeout_s: float  # one data-plane operation with a peer
    tier: Any = None  # the KV tier above storage (`--kv-pool`: the pool), None: none; its connector closes it
    step_tokens: int = 2048  # prefill tokens per step (sizes the persister's staging)
    staging_bytes: int = 0  # the persister's staging segment; 0: sized for step_tokens

    @property
    def kv(self) -> Any:
        return self.runner.kv

    @property
    def num_layers(self) -> int:
        return int(self.runner.spec.num_layers)

    def node_storage(self) -> NodeStorage:
        """A new link to the node's storage service (the connector owns it: start and close it)."""
        return NodeStorage(
            self.bus, self.runner, node=self.node, block_size=self.block_size, engine_id=self.engine_id,
            step_tokens=self.step_tokens, staging_bytes=self.staging_bytes,
        )  # fmt: skip

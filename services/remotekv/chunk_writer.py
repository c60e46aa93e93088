"""The store's side of a GET's bytes: one transport `Peer` per engine, one `write_many` per GET.

A GET names the engine's receiver (its `KvEndpoint`) and a registered region; the store writes the super
blocks straight from its own region into it, one-sidedly (shm memcpy on one host, a tcp or rdma write across
hosts). The write returns once the bytes are in the engine's region, so the GET's reply comes after them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from shared.errors import KvpathError, TransportError
from shared.protocol.kv import RemoteKvTarget
from shared.transport import KvSender, Peer

log = logging.getLogger(__name__)


class ChunkWriter:
    def __init__(self, sender: KvSender) -> None:
        self.sender = sender
        self._peers: dict[str, Peer] = {}
        self._addresses: dict[str, tuple[Any, ...]] = {}  # where each peer was opened to
        self._locks: dict[str, asyncio.Lock] = {}

    async def write(
        self, target: RemoteKvTarget, pieces: Sequence[tuple[int, Any]], *, timeout_s: float
    ) -> None:
        """Put `(offset, bytes)` pieces into the target region in one op; TransportError /
        DeadlineExceededError when the engine cannot take them (a broken peer is replaced next time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        peer = await self._peer(target, timeout_s)
        try:
            await peer.write_many(target.region, pieces, timeout_s=max(0.001, deadline - loop.time()))
        except KvpathError:
            if not peer.is_open:
                self._peers.pop(target.engine_id, None)
            raise

    async def _peer(self, target: RemoteKvTarget, timeout_s: float) -> Peer:
        """The open peer of the target's engine; a new one when the engine announces another endpoint (it
        restarted under the same id)."""
        engine_id = target.engine_id
        async with self._locks.setdefault(engine_id, asyncio.Lock()):
            peer = self._peers.get(engine_id)
            address = _address(target.endpoint)
            if peer is not None and peer.is_open and self._addresses.get(engine_id) == address:
                return peer
            if peer is not None:
                await peer.close()
            try:
                peer = await self.sender.connect(target.endpoint, timeout_s=timeout_s)
            except OSError as exc:
                raise TransportError(f"cannot reach engine {engine_id}: {exc}") from exc
            self._peers[engine_id], self._addresses[engine_id] = peer, address
            return peer

    async def close(self) -> None:
        for peer in self._peers.values():
            try:
                await peer.close()
            except Exception as exc:  # closing is best effort; the sender closes what is left
                log.debug("peer close failed: %r", exc)
        self._peers.clear()
        self._addresses.clear()


def _address(endpoint: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a receiver process in its endpoint (its regions may come and go)."""
    return tuple(endpoint.get(k) for k in ("receiver_id", "host_id", "address", "port", "shm_token"))

"""One transport `Peer` per remote engine, opened on first use and replaced when broken."""

from __future__ import annotations

import asyncio
import logging

from shared.errors import KvpathError, TransportError
from shared.protocol.tasks import BufferRef
from shared.transport import KvSender, Peer

log = logging.getLogger(__name__)


class PeerPool:
    """One transport Peer per remote engine; a broken one is replaced on next use."""

    def __init__(self, sender: KvSender) -> None:
        self.sender = sender
        self._peers: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, ref: BufferRef, *, timeout_s: float) -> Peer:
        peer = self._peers.get(ref.engine_id)
        if peer is not None and peer.is_open:
            return peer
        async with self._locks.setdefault(ref.engine_id, asyncio.Lock()):
            peer = self._peers.get(ref.engine_id)
            if peer is not None and peer.is_open:
                return peer
            try:
                peer = await self.sender.connect(ref.endpoint, timeout_s=timeout_s)
            except KvpathError:
                raise
            except OSError as exc:
                raise TransportError(f"cannot reach engine {ref.engine_id}: {exc}") from exc
            self._peers[ref.engine_id] = peer
            return peer

    async def close(self) -> None:
        for peer in self._peers.values():
            try:
                await peer.close()
            except Exception as exc:
                log.debug("peer close failed: %r", exc)
        self._peers.clear()

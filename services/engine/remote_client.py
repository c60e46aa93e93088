"""An engine's link to one remote KV store (`--kv-remote <store_id>`): metadata requests on the bus and a
transport `Peer` for the bytes it writes into the store's region.

Every call has a deadline and raises `shared.errors` types, which the tier turns into misses and skipped
writes. A store that failed is left alone for `RETRY_S` (calls fail at once), so a dead or stalled store
costs requests nothing but the first timeout. A reply from another epoch (the store restarted: its offsets
mean nothing now) drops the link; the next call looks the store up again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.bus import Bus
from shared.errors import ConfigError, KvpathError, ServiceUnavailableError, TransportError
from shared.protocol import Message
from shared.protocol.kv import (
    RemoteKvCommit,
    RemoteKvCommitReply,
    RemoteKvGet,
    RemoteKvGetReply,
    RemoteKvInfo,
    RemoteKvInfoRequest,
    RemoteKvPut,
    RemoteKvPutReply,
    RemoteKvTarget,
)
from shared.transport import KvSender, Peer

log = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failure, the store is not asked again for this long


@dataclass(slots=True, frozen=True)
class ChunkFormat:
    """What the engine stores: super blocks of `chunk_tokens` tokens, `chunk_bytes` each, KV `fingerprint`."""

    fingerprint: str
    chunk_tokens: int
    chunk_bytes: int


@dataclass(slots=True)
class StoreLink:
    info: RemoteKvInfo
    peer: Peer


class RemoteStoreClient:
    def __init__(
        self, bus: Bus, store_id: str, sender: KvSender, fmt: ChunkFormat, *, timeout_s: float
    ) -> None:
        self.bus = bus
        self.store_id = store_id
        self.sender = sender
        self.fmt = fmt
        self.timeout_s = timeout_s
        self._link: StoreLink | None = None
        self._down_until = 0.0  # monotonic
        self._lock = asyncio.Lock()

    def _subject(self, op: str) -> str:
        return self.bus.subjects.remotekv(self.store_id, op)

    # ------------------------------------------------------------------------------------------ link

    async def link(self) -> StoreLink:
        """The open link to the store, connecting when there is none (ServiceUnavailableError while the
        store is being left alone after a failure)."""
        link = self._link
        if link is not None and link.peer.is_open:
            return link
        if time.monotonic() < self._down_until:
            raise ServiceUnavailableError(f"remote KV store {self.store_id} failed recently")
        async with self._lock:
            if self._link is not None and self._link.peer.is_open:
                return self._link
            try:
                self._link = await self._connect()
            except KvpathError as exc:
                self.failed(exc)
                raise
            return self._link

    async def _connect(self) -> StoreLink:
        info = await self.bus.request(
            self._subject("info"), RemoteKvInfoRequest(), RemoteKvInfo, timeout_s=self.timeout_s
        )
        if info.chunk_tokens != self.fmt.chunk_tokens:
            raise ConfigError(
                f"store {self.store_id} holds super blocks of {info.chunk_tokens} tokens, this engine "
                f"uses {self.fmt.chunk_tokens} (remote_chunk_tokens)",
                param="remote_chunk_tokens",
            )
        try:
            peer = await self.sender.connect(info.endpoint, timeout_s=self.timeout_s)
        except OSError as exc:
            raise TransportError(f"cannot reach remote KV store {self.store_id}: {exc}") from exc
        log.info("remote KV store %s linked (epoch %d, backend %s)", self.store_id, info.epoch, peer.backend)
        return StoreLink(info, peer)

    def failed(self, exc: KvpathError) -> None:
        """Leave the store alone for a while; drop the link when its peer broke. Failures while it is left
        alone (calls refused at once, or in flight since before) neither extend the while nor log again."""
        link = self._link
        if link is not None and not link.peer.is_open:
            self._link = None
        now = time.monotonic()
        if now < self._down_until:
            return
        self._down_until = now + RETRY_S
        log.warning("remote KV store %s: %s (%s)", self.store_id, exc.message, exc.code)

    def _check_epoch(self, link: StoreLink, epoch: int) -> None:
        if epoch != link.info.epoch:
            if self._link is link:
                self._link = None
            raise ServiceUnavailableError(f"remote KV store {self.store_id} restarted (epoch {epoch})")

    async def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            with contextlib.suppress(Exception):
                await link.peer.close()

    # ------------------------------------------------------------------------------------------- ops

    async def put(self, link: StoreLink, request_id: str, keys: list[int]) -> RemoteKvPutReply:
        """Reserve slots for `keys`; the reservation lives twice the deadline of the write that follows."""
        msg = RemoteKvPut(request_id=request_id, keys=keys, timeout_s=2 * self.timeout_s, **self._format())
        reply = await self._request("put", msg, RemoteKvPutReply)
        self._check_epoch(link, reply.epoch)
        return reply

    async def write(self, link: StoreLink, pieces: Sequence[tuple[int, Any]]) -> None:
        """Write `(offset, bytes)` pieces into the store's region, one op."""
        await link.peer.write_many(link.info.region, pieces, timeout_s=self.timeout_s)

    async def commit(
        self, put_id: int, keys: list[int], checksums: list[int] | None = None
    ) -> RemoteKvCommitReply:
        msg = RemoteKvCommit(put_id=put_id, keys=keys, checksums=checksums or [])
        return await self._request("commit", msg, RemoteKvCommitReply)

    async def get(
        self, link: StoreLink, request_id: str, keys: list[int], target: RemoteKvTarget, timeout_s: float
    ) -> RemoteKvGetReply:
        """Have the store write the longest prefix of `keys` it holds into `target`; the reply comes once
        the bytes are there."""
        msg = RemoteKvGet(
            request_id=request_id, keys=keys, target=target, timeout_s=timeout_s, **self._format()
        )
        reply = await self._request("get", msg, RemoteKvGetReply, timeout_s=timeout_s)
        self._check_epoch(link, reply.epoch)
        return reply

    def _format(self) -> dict[str, Any]:
        f = self.fmt
        return {"fingerprint": f.fingerprint, "chunk_tokens": f.chunk_tokens, "chunk_bytes": f.chunk_bytes}

    async def _request(self, op: str, msg: Message, reply_type: type[Any], *, timeout_s: float = 0.0) -> Any:
        return await self.bus.request(
            self._subject(op), msg, reply_type, timeout_s=timeout_s or self.timeout_s
        )

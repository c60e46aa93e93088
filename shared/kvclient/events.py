"""KV events (BlockStored / BlockRemoved / Cleared) on their JetStream stream: publishing, and creating the
stream idempotently (whoever starts first)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import StorageType, StreamConfig

from shared.bus import Bus
from shared.errors import (
    DeadlineExceededError,
    ServiceUnavailableError,
)
from shared.protocol import encode
from shared.protocol.kv import (
    BlockRemoved,
    BlockStored,
    Cleared,
    KvEvent,
)

_DUPLICATE_WINDOW_S = 120.0
ELECTION_WAIT_S = 15.0  # how long an event waits out its replicated stream's leader election


async def ensure_kv_events_stream(bus: Bus, *, max_bytes: int = -1) -> str:
    """Create the KV-events JetStream stream if it does not exist (idempotent, race-safe); return its name."""
    name = bus.subjects.kv_events_stream
    try:
        try:
            await bus.js.stream_info(name)
            return name
        except nats.js.errors.NotFoundError:
            pass
        config = StreamConfig(
            name=name,
            subjects=[bus.subjects.kv_events_all],
            storage=StorageType.FILE,
            max_bytes=max_bytes,
            duplicate_window=_DUPLICATE_WINDOW_S,
            num_replicas=bus.jetstream_replicas,
        )
        try:
            await bus.js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await bus.js.stream_info(name)  # created concurrently by another service
    except (nats.errors.Error, TimeoutError) as exc:
        raise ServiceUnavailableError(f"cannot create KV-events stream {name}: {exc!r}") from exc
    return name


class KvEventPublisher:
    """Publishes one source's KV events in order, with (epoch, seq) for idempotent consumers.

    Publishes are serialized so stream order equals seq order; each waits for the stream's ack and
    returns the stream sequence (which `IndexClient.wait_applied` can wait for).
    """

    def __init__(self, bus: Bus, source: str, *, timeout_s: float | None = None) -> None:
        self.bus = bus
        self.source = source
        self.subject = bus.subjects.kv_events(source)
        self.timeout_s = timeout_s or bus.request_timeout_s
        self.epoch = time.time_ns()
        self._seq = 0
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await ensure_kv_events_stream(self.bus)

    async def stored(
        self,
        location: str,
        block_hashes: Sequence[int],
        parent_hashes: Sequence[int] = (),
        *,
        block_tokens: int = 0,
    ) -> int:
        """Announce blocks readable at `location`; return the event's stream sequence."""
        return await self._publish(
            BlockStored,
            location=location,
            block_hashes=[int(h) for h in block_hashes],
            parent_hashes=[int(h) for h in parent_hashes],
            block_tokens=block_tokens,
        )

    async def removed(self, location: str, block_hashes: Sequence[int], *, reason: str = "") -> int:
        return await self._publish(
            BlockRemoved, location=location, block_hashes=[int(h) for h in block_hashes], reason=reason
        )

    async def cleared(self, locations: Sequence[str], *, reason: str = "") -> int:
        return await self._publish(Cleared, locations=list(locations), reason=reason)

    async def _publish(self, kind: type[KvEvent], **fields: Any) -> int:
        """Publish the next event of this source; return its stream sequence.

        A replicated stream answers "no response from stream", or nothing within the timeout, while its
        replicas elect a leader (a clustered nats-server lost: ~6 s measured under load, every event of
        those seconds lost before).
        The event is sent again until it is stored or `ELECTION_WAIT_S` passed: its `Nats-Msg-Id` makes the
        server drop a copy it stored already, and later events of this source wait (the lock), in order."""
        async with self._lock:
            self._seq += 1
            event = kind(source=self.source, epoch=self.epoch, seq=self._seq, sent_at=time.time(), **fields)
            headers = {"Nats-Msg-Id": f"{self.source}:{self.epoch}:{self._seq}"}  # server-side dedupe
            try:
                return await self._send(encode(event), headers, time.monotonic() + ELECTION_WAIT_S)
            except (nats.errors.TimeoutError, TimeoutError) as exc:
                raise DeadlineExceededError(f"KV event not acknowledged on {self.subject}") from exc
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                raise ServiceUnavailableError(f"cannot publish KV event on {self.subject}: {exc!r}") from exc

    async def _send(self, data: bytes, headers: dict[str, str], deadline: float) -> int:
        delay = 0.02
        while True:
            try:
                ack = await self.bus.js.publish(self.subject, data, timeout=self.timeout_s, headers=headers)
                return int(ack.seq)
            except (nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError):
                # no answer at all is the election too (the request reached no leader): sent again, the
                # message id makes a copy the stream stored already a no-op
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.5)

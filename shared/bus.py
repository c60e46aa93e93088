"""NATS client wrapper: connect with reconnect, typed publish / request / subscribe, JetStream, registry.

Handlers receive decoded, validated messages. A malformed message is logged, counted and, when the sender
waits for a reply, answered with an `ErrorReply`; it never reaches the handler and never kills the service.
Trace context travels in message headers (`shared.telemetry`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from shared import telemetry
from shared.bus_auth import NatsAuth, redact_url
from shared.bus_epochs import DEFAULT_GRACE_S, ConnectionEpochs
from shared.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KvpathError,
    ProtocolError,
    ServiceUnavailableError,
    error_from_code,
)
from shared.protocol import ErrorReply, Message, ServiceInfo, Subjects, decode, encode
from shared.protocol.codec import from_dict

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


@dataclass(slots=True)
class MsgContext:
    """What a handler may want besides the decoded message."""

    subject: str
    reply: str
    headers: dict[str, str] | None

    @property
    def trace_parent(self) -> Any:
        return telemetry.extract_context(self.headers)


Handler = Callable[[M, MsgContext], Awaitable[Message | None]]


def _kind_of(subject: str, prefix: str) -> str:
    rest = subject[len(prefix) + 1 :] if subject.startswith(prefix) else subject
    return rest.split(".", 1)[0] or "?"


class Bus:
    """One NATS connection of one service."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        name: str,
        request_timeout_s: float = 5.0,
        auth: NatsAuth | None = None,
        jetstream_replicas: int = 1,
        lost_reply_grace_s: float = DEFAULT_GRACE_S,
    ) -> None:
        self.url = url
        self.auth = auth or NatsAuth()
        self.jetstream_replicas = jetstream_replicas  # of the streams and buckets this bus creates
        self.subjects = Subjects(namespace)
        self.name = name
        self.request_timeout_s = request_timeout_s
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.is_connected = asyncio.Event()
        self._is_closing = False  # our own close: the disconnect it causes is no news
        self._epochs = ConnectionEpochs(lost_reply_grace_s)  # requests a disconnect may have orphaned

    # ------------------------------------------------------------------------------------ connection

    async def connect(self, *, timeout_s: float = 10.0) -> None:
        async def on_error(exc: Exception) -> None:
            telemetry.BUS_ERRORS.labels("connection").inc()
            log.warning("bus error name=%s: %s", self.name, redact_url(str(exc)))

        async def on_disconnected() -> None:
            self.is_connected.clear()
            if not self._is_closing:
                self._epochs.disconnected()
                log.warning("bus disconnected name=%s", self.name)

        async def on_reconnected() -> None:
            self.is_connected.set()
            log.info("bus reconnected name=%s", self.name)

        servers = [s.strip() for s in self.url.split(",") if s.strip()]
        options = self.auth.connect_options()
        try:
            self._nc = await asyncio.wait_for(
                nats.connect(
                    servers=servers,
                    **options,
                    name=self.name,
                    connect_timeout=min(2.0, timeout_s),
                    reconnect_time_wait=0.5,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                ),
                timeout_s,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise ServiceUnavailableError(
                f"cannot connect to NATS at {redact_url(self.url)}: {redact_url(repr(exc))}"
            ) from exc
        self.is_connected.set()

    @property
    def nc(self) -> NatsClient:
        if self._nc is None:
            raise ServiceUnavailableError("bus not connected")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            self._js = self.nc.jetstream()
        return self._js

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload)

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Return once the server has processed everything sent so far (a SUB included)."""
        # nats-py's flush() writes its PING straight to the socket, ahead of commands still queued for its
        # flusher task: a SUB made just before could reach the server after the PING, so another
        # connection's request, sent on the PONG, met no responders (a CI flake). Drain that queue first.
        try:
            await asyncio.wait_for(self.nc._flush_pending(force_flush=True), timeout_s)
        except TimeoutError as exc:
            raise DeadlineExceededError(f"bus flush did not finish in {timeout_s:.1f} s") from exc
        await self.nc.flush(timeout=max(1, round(timeout_s)))

    async def close(self, timeout_s: float = 5.0) -> None:
        """Unsubscribe, let in-flight handlers finish within the deadline, drain the connection."""
        self._is_closing = True
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), timeout_s)
            if not self._nc.is_closed:
                with contextlib.suppress(Exception):
                    await self._nc.close()
        self.is_connected.clear()

    # --------------------------------------------------------------------------------------- publish

    async def publish(self, subject: str, msg: Message, *, headers: dict[str, str] | None = None) -> None:
        await self.publish_bytes(subject, encode(msg), headers=headers)

    async def publish_bytes(
        self, subject: str, data: bytes, *, headers: dict[str, str] | None = None
    ) -> None:
        telemetry.BUS_MESSAGES.labels("out", _kind_of(subject, self.subjects.prefix)).inc()
        try:
            await self.nc.publish(subject, data, headers=telemetry.inject_headers(headers))
        except nats.errors.MaxPayloadError:
            raise self._too_large(subject, len(data)) from None

    async def request(
        self,
        subject: str,
        msg: Message,
        reply_type: type[R] | tuple[type[R], ...],
        *,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> R:
        """Send a request and decode the reply; an `ErrorReply` is raised as the error it names."""
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        telemetry.BUS_MESSAGES.labels("out", _kind_of(subject, self.subjects.prefix)).inc()
        try:
            sent = self.nc.request(
                subject, encode(msg), timeout=timeout, headers=telemetry.inject_headers(headers)
            )
            reply = await self._epochs.reply(subject, sent)
        except nats.errors.NoRespondersError:
            raise ServiceUnavailableError(f"no service answers on {subject}") from None
        except nats.errors.MaxPayloadError:
            raise self._too_large(subject, len(encode(msg))) from None
        except nats.errors.TimeoutError:
            telemetry.BUS_ERRORS.labels("timeout").inc()
            raise DeadlineExceededError(f"no reply on {subject} within {timeout:.1f}s") from None
        return self.decode_reply(reply.data, reply_type)

    def _too_large(self, subject: str, size: int) -> InvalidRequestError:
        telemetry.BUS_ERRORS.labels("too_large").inc()
        return InvalidRequestError(
            f"message of {size} bytes for {subject} exceeds the bus limit of {self.max_payload} bytes "
            f"(nats-server max_payload)",
            param="prompt",
        )

    @staticmethod
    def decode_reply(data: bytes, reply_type: type[R] | tuple[type[R], ...]) -> R:
        types_ = reply_type if isinstance(reply_type, tuple) else (reply_type,)
        obj: Message = decode(data, (*types_, ErrorReply))
        if isinstance(obj, ErrorReply):
            raise error_from_code(obj.code, obj.message, obj.param)
        return obj  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------- subscribe

    async def subscribe(
        self,
        subject: str,
        msg_type: type[M] | tuple[type[M], ...],
        handler: Handler[M],
        *,
        queue: str = "",
        max_concurrency: int = 1,
    ) -> Subscription:
        """Serve `subject`: decode, validate, call `handler`, reply with its result (or an ErrorReply).

        max_concurrency == 1 runs handlers inline in arrival order; > 1 runs up to that many at once.
        """
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency > 1 else None

        async def on_msg(raw: Msg) -> None:
            telemetry.BUS_MESSAGES.labels("in", _kind_of(raw.subject, self.subjects.prefix)).inc()
            if semaphore is None:
                await self._dispatch(raw, msg_type, handler)
                return
            await semaphore.acquire()
            task = asyncio.create_task(self._dispatch(raw, msg_type, handler))
            self._tasks.add(task)

            def done(t: asyncio.Task[None]) -> None:
                self._tasks.discard(t)
                semaphore.release()

            task.add_done_callback(done)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._subs.append(sub)
        return sub

    async def _dispatch(self, raw: Msg, msg_type: type[M] | tuple[type[M], ...], handler: Handler[M]) -> None:
        ctx = MsgContext(subject=raw.subject, reply=raw.reply, headers=raw.headers)
        try:
            msg = decode(raw.data, msg_type)
        except ProtocolError as exc:
            telemetry.BUS_ERRORS.labels("malformed").inc()
            log.warning("malformed message subject=%s error=%s", raw.subject, exc.message)
            await self._reply(raw, ErrorReply.from_error(exc))
            return
        try:
            result = await handler(msg, ctx)
        except KvpathError as exc:
            await self._reply(raw, ErrorReply.from_error(exc))
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a handler bug must not kill the subscription
            telemetry.BUS_ERRORS.labels("handler").inc()
            log.exception("handler failed subject=%s", raw.subject)
            await self._reply(raw, ErrorReply(code="internal_error", message=f"{type(exc).__name__}: {exc}"))
            return
        if result is not None:
            await self._reply(raw, result)

    async def _reply(self, raw: Msg, reply: Message) -> None:
        if not raw.reply:
            return
        try:
            await self.nc.publish(raw.reply, encode(reply))
        except nats.errors.Error as exc:
            log.warning("reply failed subject=%s: %s", raw.subject, exc)

    async def subscribe_raw(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """Subscribe without decoding, for hot paths that decode themselves (see `decode_raw`)."""
        sub = await self.nc.subscribe(subject, cb=cb)
        self._subs.append(sub)
        return sub

    # ------------------------------------------------------------------------------------- jetstream

    async def key_value(self, bucket: str, *, ttl_s: float | None = None, history: int = 1) -> KeyValue:
        """Open (creating if needed) a JetStream KV bucket."""
        try:
            return await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            pass
        config = KeyValueConfig(bucket=bucket, history=history, ttl=ttl_s, replicas=self.jetstream_replicas)
        try:
            return await self.js.create_key_value(config=config)
        except nats.js.errors.BadRequestError:
            # created concurrently by another service
            return await self.js.key_value(bucket)


def decode_raw(data: bytes, msg_type: type[M]) -> M:
    return decode(data, msg_type)


REGISTRY_SETTLE_S = 10.0  # how long a registry write waits out a replicated bucket's leader election


class Registry(Generic[M]):
    """Live services in a JetStream KV bucket; each entry expires `ttl_s` after its last heartbeat."""

    def __init__(self, bus: Bus, ttl_s: float) -> None:
        self.bus = bus
        self.ttl_s = ttl_s
        self._kv: KeyValue | None = None

    async def open(self) -> None:
        self._kv = await self.bus.key_value(self.bus.subjects.registry_bucket, ttl_s=self.ttl_s)

    @property
    def kv(self) -> KeyValue:
        if self._kv is None:
            raise ServiceUnavailableError("registry not open")
        return self._kv

    async def put(self, info: ServiceInfo, *, settle_s: float = REGISTRY_SETTLE_S) -> None:
        """Write the entry. A replicated bucket answers "no response from stream" while its replicas elect
        a leader (just created in a NATS cluster, or a server lost): retried for up to `settle_s`."""
        deadline = time.monotonic() + settle_s
        delay = 0.02
        while True:
            info.heartbeat_at = time.time()
            try:
                await self.kv.put(info.service_id, encode(info))
                return
            except nats.js.errors.NoStreamResponseError:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.5)

    async def remove(self, service_id: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError, nats.errors.Error):
            await self.kv.delete(service_id)

    async def list(self) -> list[ServiceInfo]:
        """Every live service; entries past their TTL or malformed are skipped."""
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        out: list[ServiceInfo] = []
        now = time.time()
        for key in keys:
            try:
                entry = await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue
            if not entry.value:
                continue
            try:
                info = decode(entry.value, ServiceInfo)
            except ProtocolError as exc:
                log.warning("malformed registry entry key=%s: %s", key, exc.message)
                continue
            if now - info.heartbeat_at <= self.ttl_s:
                out.append(info)
        return out


__all__ = ["Bus", "MsgContext", "Registry", "decode_raw", "from_dict"]

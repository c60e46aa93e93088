"""The CXL-RPC calls over NATS request/reply, for clients on other hosts: same handler, same statuses.

Raw bytes on the wire, a tiny little-endian header before the payload:
    request  u32 op, u32 client_id, payload
    reply    u32 status, reply
The server calls the same `Handler` the shared-memory server does, inline on its event loop (handlers are
short and synchronous); the client raises the transport's statuses as `shared.errors` exceptions exactly as
`RpcClient` does. There is no liveness tracking here (no `on_client_dead`): NATS clients are identified only
by the `client_id` they send, which the service built on this must keep apart from shared-memory entries.
"""

from __future__ import annotations

import asyncio
import logging
import struct

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.bus import Bus
from shared.cxl.layout import MAX_OP
from shared.cxl.rpc_status import (
    FIRST_HANDLER_STATUS,
    MAX_STATUS,
    STATUS_BAD_REQUEST,
    STATUS_BAD_STATUS,
    STATUS_HANDLER_ERROR,
    STATUS_REPLY_TOO_LARGE,
    Handler,
    check_op,
    error_for_status,
    is_transport_status,
)
from shared.errors import DeadlineExceededError, InvalidRequestError, ProtocolError, ServiceUnavailableError

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<II")  # op, client_id
_REPLY = struct.Struct("<I")  # status
Payload = bytes | bytearray | memoryview


class NatsRpcServer:
    """Answers CXL-RPC calls on `subject` with `handler`; `start()` subscribes and flushes."""

    def __init__(self, bus: Bus, subject: str, handler: Handler) -> None:
        self.bus = bus
        self.subject = subject
        self._handler = handler
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe_raw(self.subject, self._on_request)
        await self.bus.flush()

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
                await self.bus.flush()  # the server drops our interest before stop() returns
            except nats.errors.Error as exc:  # the connection is already closing
                log.debug("cxl-rpc nats unsubscribe %s: %s", self.subject, exc)

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        status, reply = self.answer(msg.data)
        try:
            await self.bus.nc.publish(msg.reply, _REPLY.pack(status) + reply)
        except nats.errors.Error as exc:
            log.warning("cxl-rpc nats reply failed subject=%s: %s", self.subject, exc)

    def answer(self, data: bytes) -> tuple[int, bytes]:
        """(status, reply) for one raw request; never raises."""
        if len(data) < _REQUEST.size:
            return STATUS_BAD_REQUEST, f"request of {len(data)} bytes has no header".encode()
        op, client_id = _REQUEST.unpack_from(data)
        if op > MAX_OP:
            return STATUS_BAD_REQUEST, f"op {op} (max {MAX_OP})".encode()
        try:
            status, reply = self._handler(client_id, op, memoryview(data)[_REQUEST.size :])
            reply = bytes(reply)
            if not (status == 0 or FIRST_HANDLER_STATUS <= status <= MAX_STATUS):
                return STATUS_BAD_STATUS, f"handler returned status {status} for op {op}".encode()
        except Exception as exc:
            log.warning("cxl-rpc handler failed client=%d op=%d", client_id, op, exc_info=True)
            return STATUS_HANDLER_ERROR, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        limit_bytes = self.bus.max_payload - _REPLY.size
        if len(reply) > limit_bytes:
            return (
                STATUS_REPLY_TOO_LARGE,
                f"op {op} replied {len(reply)} bytes, the bus carries {limit_bytes}".encode(),
            )
        return int(status), reply


class NatsRpcClient:
    """Calls a `NatsRpcServer` on `subject`. `acall` on the bus's event loop; `call` from other threads."""

    def __init__(self, bus: Bus, subject: str, *, client_id: int = 0) -> None:
        if not 0 <= client_id <= 0xFFFFFFFF:
            raise ValueError(f"client_id must fit in 32 bits, got {client_id}")
        self.bus = bus
        self.subject = subject
        self.client_id = client_id
        self._loop = _running_loop()  # else learnt on the first acall

    async def acall(self, op: int, payload: Payload = b"", timeout_s: float = 1.0) -> tuple[int, bytes]:
        """Send one request; (status, reply) with the handler's statuses, transport statuses raised."""
        check_op(op)
        self._loop = self._loop or asyncio.get_running_loop()
        data = _REQUEST.pack(op, self.client_id) + bytes(payload)
        try:
            msg = await self.bus.nc.request(self.subject, data, timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise ServiceUnavailableError(f"no CXL-RPC server answers on {self.subject}") from None
        except nats.errors.TimeoutError:
            raise DeadlineExceededError(
                f"no CXL-RPC reply on {self.subject} within {timeout_s:.3f}s"
            ) from None
        except nats.errors.MaxPayloadError:
            raise InvalidRequestError(
                f"CXL-RPC payload of {len(payload)} bytes exceeds the bus limit", param="payload"
            ) from None
        except nats.errors.ConnectionClosedError:
            raise ServiceUnavailableError("bus connection closed") from None
        if len(msg.data) < _REPLY.size:
            raise ProtocolError(f"CXL-RPC reply of {len(msg.data)} bytes on {self.subject} has no header")
        status = _REPLY.unpack_from(msg.data)[0]
        reply = msg.data[_REPLY.size :]
        if is_transport_status(status):
            raise error_for_status(status, reply)
        return status, reply

    def call(self, op: int, payload: Payload = b"", timeout_s: float = 1.0) -> tuple[int, bytes]:
        """`acall` from a thread other than the bus's event loop (which it would otherwise deadlock)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise ServiceUnavailableError(
                "NatsRpcClient.call needs acall to have run on the bus's loop first"
            )
        if _running_loop() is loop:
            raise RuntimeError("NatsRpcClient.call on the bus's event loop would block it: use acall")
        future = asyncio.run_coroutine_threadsafe(self.acall(op, bytes(payload), timeout_s), loop)
        try:
            return future.result(timeout_s + 1.0)
        except TimeoutError:
            future.cancel()
            raise DeadlineExceededError(
                f"no CXL-RPC reply on {self.subject} within {timeout_s:.3f}s"
            ) from None

    def close(self) -> None:
        """Nothing to release: the bus belongs to the caller."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

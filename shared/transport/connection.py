"""Receiver side of one control connection: read frames, land payloads in regions, answer every op.

Thin shell around `FrameReader`: the socket's readable callback feeds `recvmsg_into` with the buffers the
reader asks for (region slices during a payload). Semantics (regions, notices, hello) belong to the
receiver (`ReceiverCore`). A malformed frame closes this connection only; other connections keep going.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, Protocol

import numpy as np

from shared.errors import KvpathError, TransportError
from shared.protocol.codec import decode, encode
from shared.protocol.messages import ErrorReply
from shared.protocol.transfer import RegionInfo, TransferHello, TransferWelcome
from shared.transport.notices import Notice
from shared.transport.reader import FrameReader
from shared.transport.region import Region
from shared.transport.spin import Spinner
from shared.transport.wire import (
    IMM,
    SENDER_TYPES,
    FrameError,
    FrameType,
    Header,
    Limits,
    extents_in_bounds,
    pack,
    pack_fields,
)

log = logging.getLogger(__name__)
_ACK = int(FrameType.ACK)
_BYE = pack(Header(FrameType.BYE))  # this receiver is stopping (header only)
_READ_BUDGET_BYTES = 8 << 20  # per readable callback, so one busy sender cannot starve the others


class ReceiverCore(Protocol):
    """What a connection asks of its receiver (implemented by KvReceiver)."""

    receiver_id: str
    limits: Limits
    max_reply_backlog_bytes: int
    spin_s: float  # after a frame, poll the socket this long for the next one (once per readable callback)

    def region_by_id(self, region_id: int) -> Region | None: ...
    def region_by_name(self, name: str) -> Region | None: ...
    def region_info(self, region: Region) -> RegionInfo: ...
    def welcome(self, conn: ReceiverConnection, hello: TransferHello) -> TransferWelcome: ...
    def post_notice(self, notice: Notice) -> None: ...
    def fail_notice(self, region: str, tag: int, error: KvpathError) -> None: ...
    async def join_immediate(self, conn: ReceiverConnection, imm: int) -> None: ...
    def connection_closed(self, conn: ReceiverConnection, reason: str) -> None: ...


class ReceiverConnection:
    """One sender's control connection. `peer_id` and `backend` are known after its HELLO."""

    def __init__(self, core: ReceiverCore, sock: socket.socket, address: str) -> None:
        self.core = core
        self.address = address
        self.peer_id = ""
        self.backend = ""
        self.rdma: Any = None  # per-connection RDMA state, owned by the receiver's RDMA side
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._reader = FrameReader(self, core.limits, SENDER_TYPES)
        self._spinner = Spinner(core.spin_s)
        self._spin_queued = False
        self._out = bytearray()
        self._write_error: KvpathError | None = None
        self._write_region: Region | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._close_when_flushed = False
        self.is_closed = False

    def start(self) -> None:
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    # ------------------------------------------------------------------ socket callbacks
    def _on_readable(self) -> None:
        """Read and handle frames until the socket is dry; then poll it briefly for the sender's next frame
        (`spin.Spinner`: bounded, adaptive): a sender with one op in flight sends the next within
        microseconds of our reply, and catching it here skips two wakeups through the event loop."""
        if self._read_until_dry() >= 0 and self._spinner.budget_s:
            self._spin_soon()

    def _spin_soon(self) -> None:
        """Poll once the loop has run what is ready (a notice's waiter among them: it learns of its notice
        before we poll, not after), and after each poll that caught a frame, poll again, so that a sender
        streaming one op at a time finds us awake on every frame rather than waking us from epoll on every
        other one. A miss (or a closed connection) ends the chain; the next readable callback starts one."""
        if not self._spin_queued and self._spinner.chance():  # backing off: no extra turn of the loop
            self._spin_queued = True
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        self._spin_queued = False
        if not self.is_closed and self._spinner.spin(self._read_more) and not self.is_closed:
            self._spin_soon()

    def _read_more(self) -> bool:
        """One spin step: True once whole frames arrived (handled, answered) or the spin must end; a frame
        still arriving (a tcp payload in pieces) keeps the spin going rather than waking up for the rest."""
        nbytes = self._read_until_dry()
        return nbytes < 0 or (nbytes > 0 and self._reader.is_idle)

    def _read_until_dry(self) -> int:
        """Receive and handle frames until the socket is dry: the bytes read; -1 when the connection closed
        or `_READ_BUDGET_BYTES` ran out first (the loop calls back for the rest)."""
        budget = _READ_BUDGET_BYTES
        while budget > 0 and not self.is_closed:
            try:
                nbytes = self._sock.recvmsg_into(self._reader.buffers())[0]
            except (BlockingIOError, InterruptedError):
                return _READ_BUDGET_BYTES - budget
            except OSError as exc:
                self.close(f"receive failed: {exc}")
                return -1
            if nbytes == 0:
                clean = self._reader.is_idle
                self.close("connection closed by peer" if clean else "connection lost mid-frame")
                return -1
            budget -= nbytes
            self._advance(nbytes)
        return -1

    def _advance(self, nbytes: int) -> None:
        try:
            self._reader.advance(nbytes)
        except FrameError as exc:
            log.error("kv receiver: malformed frame from %s peer=%s: %s", self.address, self.peer_id, exc)
            self.close(f"malformed frame: {exc.message}")
        except Exception as exc:
            log.exception("kv receiver: failed handling a frame from %s peer=%s", self.address, self.peer_id)
            self.close(f"internal error: {exc!r}")

    def _on_writable(self) -> None:
        self._flush()

    # ------------------------------------------------------------------ FrameSink
    def on_frame(self, header: Header, meta: bytes) -> None:
        if not self.peer_id and header.type is not FrameType.HELLO:
            raise FrameError(f"first frame must be HELLO, got {header.type.name}")
        if header.type is FrameType.HELLO:
            self._on_hello(header, meta)
        elif header.type is FrameType.LOOKUP:
            self._on_lookup(header, meta)
        elif header.type is FrameType.NOTICE:
            self._on_notice(header, meta)
        elif header.type is FrameType.BYE:
            self.close("closed by sender", bye=True)

    def on_write_begin(self, header: Header, extents: np.ndarray, meta: bytes) -> list[memoryview] | None:
        if not self.peer_id:
            raise FrameError("first frame must be HELLO, got WRITE")
        region = self.core.region_by_id(header.region_id)
        self._write_region, self._write_error = region, None
        if region is None:
            self._write_error = TransportError(f"unknown region id {header.region_id}", param="region")
            return None
        if not extents_in_bounds(extents, region.size_bytes):
            self._write_error = TransportError(
                f"write out of bounds of region {region.name!r} ({region.size_bytes} bytes)", param="offset"
            )
            return None
        whole = region.buffer(0, region.size_bytes)
        return [whole[offset : offset + length] for offset, length in extents.tolist()]

    def on_write_end(self, header: Header, meta: bytes) -> None:
        region, error = self._write_region, self._write_error
        self._write_region = self._write_error = None
        if error is None and region is not None and self.core.region_by_id(region.region_id) is not region:
            error = TransportError(
                f"region {region.name!r} was unregistered during the write", param="region"
            )
        if error is None and region is not None and header.has_notice:
            notice = Notice(region.name, header.tag, meta, self.peer_id, header.payload_len)
            error = self._try_post(notice)
        self._answer(header.seq, error)

    # ------------------------------------------------------------------ frames
    def _on_hello(self, header: Header, meta: bytes) -> None:
        if self.peer_id:
            raise FrameError("second HELLO on one connection")
        try:
            welcome = self.core.welcome(self, decode(meta, TransferHello))
        except KvpathError as exc:
            log.warning("kv receiver: refused hello from %s: %s", self.address, exc.message)
            self._reply(Header(FrameType.ERROR, seq=header.seq), encode(ErrorReply.from_error(exc)))
            self._close_when_flushed = True
            self._flush()
            return
        self._reply(Header(FrameType.WELCOME, seq=header.seq), encode(welcome))

    def _on_lookup(self, header: Header, meta: bytes) -> None:
        name = meta.decode("utf-8", errors="replace")
        region = self.core.region_by_name(name)
        if region is None:
            self._answer(header.seq, TransportError(f"no region named {name!r}", param="region"))
            return
        self._reply(Header(FrameType.REGION, seq=header.seq), encode(self.core.region_info(region)))

    def _on_notice(self, header: Header, meta: bytes) -> None:
        region = self.core.region_by_id(header.region_id)
        if region is None:
            self._answer(header.seq, TransportError(f"unknown region id {header.region_id}", param="region"))
            return
        notice = Notice(region.name, header.tag, meta, self.peer_id, header.value)
        if int(header.flags) & IMM:
            task = self._loop.create_task(self._join_and_post(header, notice))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._answer(header.seq, self._try_post(notice))

    async def _join_and_post(self, header: Header, notice: Notice) -> None:
        try:
            await self.core.join_immediate(self, header.aux)
        except KvpathError as exc:
            self._answer(header.seq, exc)
            return
        except asyncio.CancelledError:
            error = TransportError(f"peer {self.peer_id} lost before its RDMA notice completed")
            self.core.fail_notice(notice.region, notice.tag, error)
            raise
        self._answer(header.seq, self._try_post(notice))

    def _try_post(self, notice: Notice) -> KvpathError | None:
        try:
            self.core.post_notice(notice)
        except KvpathError as exc:
            return exc
        return None

    # ------------------------------------------------------------------ replies
    def _answer(self, seq: int, error: KvpathError | None) -> None:
        if error is None:
            self._send_frame(pack_fields(_ACK, 0, seq, 0, 0, 0, 0, 0, 0))
        else:
            self._reply(Header(FrameType.ERROR, seq=seq), encode(ErrorReply.from_error(error)))

    def _reply(self, header: Header, meta: bytes = b"") -> None:
        self._send_frame(pack(Header(header.type, seq=header.seq, meta_len=len(meta))) + meta)

    def _send_frame(self, frame: bytes) -> None:
        if self.is_closed:
            return
        if not self._out:
            try:
                sent = self._sock.send(frame)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.close(f"send failed: {exc}")
                return
            if sent == len(frame):
                return
            frame = frame[sent:]
            self._loop.add_writer(self._sock.fileno(), self._on_writable)
        self._out += frame
        if len(self._out) > self.core.max_reply_backlog_bytes:
            self.close(f"sender stopped reading replies ({len(self._out)} bytes backlog)")

    def _flush(self) -> None:
        if self._out:
            try:
                sent = self._sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"send failed: {exc}")
                return
            del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self._sock.fileno())
            if self._close_when_flushed:
                self.close("hello refused")

    # ------------------------------------------------------------------ teardown
    def close(self, reason: str, *, bye: bool = False, say_bye: bool = False) -> None:
        """Idempotent. A WRITE cut off midway fails the notice it carried (its waiter learns at once).
        `say_bye`: this receiver is stopping: a BYE frame first (best effort, unless replies are backed
        up), so that the sender knows the close was meant."""
        if self.is_closed:
            return
        if say_bye and not self._out:
            with contextlib.suppress(OSError):
                self._sock.send(_BYE)
        self.is_closed = True
        current = self._reader.current
        if current is not None and current.type is FrameType.WRITE and current.has_notice:
            region = self.core.region_by_id(current.region_id)
            if region is not None:
                error = TransportError(f"peer {self.peer_id or self.address} lost mid-transfer: {reason}")
                self.core.fail_notice(region.name, current.tag, error)
        fd = self._sock.fileno()
        if fd >= 0:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)
        self._sock.close()
        for task in list(self._tasks):
            task.cancel()
        level = logging.DEBUG if bye else logging.INFO
        log.log(
            level, "kv receiver: connection from %s peer=%s closed: %s", self.address, self.peer_id, reason
        )
        self.core.connection_closed(self, reason)

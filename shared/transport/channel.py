"""Sender side of a control connection: numbered frames out, replies matched back by sequence number.

One `ControlChannel` per `Peer`. Frames of one op go out under a lock (they must not interleave with
another op's); replies are parsed by a reader callback and resolve the op's future. When the connection
breaks, every op in flight fails with TransportError at once and the channel refuses new ops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import Sequence

import numpy as np

from shared.errors import KvpathError, TransportError, error_from_code
from shared.protocol.codec import decode
from shared.protocol.messages import ErrorReply
from shared.transport.reader import MAX_IOV, FrameReader
from shared.transport.sockio import send_buffers, skip_bytes, tune_socket
from shared.transport.spin import Spinner
from shared.transport.timeouts import Deadline, DeadlineWatch, deadline
from shared.transport.wire import HEADER_BYTES, RECEIVER_TYPES, U32_MAX, FrameType, Header, Limits, pack

log = logging.getLogger(__name__)

Reply = tuple[Header, bytes]


class ControlChannel:
    def __init__(self, sock: socket.socket, *, name: str, limits: Limits, spin_s: float = 0.0) -> None:
        self.name = name
        self.spinner = Spinner(spin_s)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._send_lock = asyncio.Lock()
        self._num_senders = 0  # ops holding or waiting for the send lock
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._deadlines = DeadlineWatch(self._loop, self._pending)
        self._seq = 0
        self._reader = FrameReader(self, limits, RECEIVER_TYPES)
        self._broken: TransportError | None = None
        self._receiver_stopped = False  # it said BYE
        self._loop.add_reader(sock.fileno(), self._on_readable)

    @classmethod
    async def open(
        cls, host: str, port: int, *, name: str, limits: Limits, buffer_bytes: int, spin_s: float = 0.0
    ) -> ControlChannel:
        """Connect (the caller bounds this with its deadline)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        last: OSError | None = None
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                tune_socket(sock, buffer_bytes)
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            except BaseException:
                sock.close()
                raise
            return cls(sock, name=name, limits=limits, spin_s=spin_s)
        raise TransportError(f"cannot connect to KV receiver {name} at {host}:{port}: {last}")

    @classmethod
    async def open_unix(
        cls, path: str, *, name: str, limits: Limits, buffer_bytes: int, spin_s: float = 0.0
    ) -> ControlChannel:
        """Connect over the receiver's Unix socket (an shm peer: the control frames skip loopback TCP)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            tune_socket(sock, buffer_bytes)
            await asyncio.get_running_loop().sock_connect(sock, path)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot connect to KV receiver {name} at {path}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        return cls(sock, name=name, limits=limits, spin_s=spin_s)

    @property
    def kind(self) -> str:
        """What carries the control frames: "unix" or "tcp"."""
        return "unix" if self._sock.family == socket.AF_UNIX else "tcp"

    @property
    def is_broken(self) -> bool:
        return self._broken is not None

    def next_seq(self) -> int:
        self._seq = (self._seq + 1) & U32_MAX
        return self._seq

    def expect(self, seq: int) -> asyncio.Future[Reply]:
        """Register for the reply to `seq` before sending the frame that asks for it."""
        self.check()
        future: asyncio.Future[Reply] = self._loop.create_future()
        self._pending[seq] = future
        return future

    def forget(self, seq: int) -> None:
        self._pending.pop(seq, None)

    def check(self) -> None:
        if self._broken is not None:
            raise self._broken

    async def send(
        self, buffers: Sequence[memoryview | bytes], nbytes: int = -1, when: Deadline | None = None
    ) -> None:
        """Send one op's frames (`nbytes` in all, -1: count them); a failure or cancellation midway breaks
        the channel.

        Fast path: nobody else sending, one `sendmsg` of every buffer, no lock and no suspension. What
        the kernel did not take goes out under the send lock (bounded by `when`, if given).
        """
        if self._broken is not None:
            raise self._broken
        if nbytes < 0:
            nbytes = sum(len(b) for b in buffers)
        if not self._num_senders and len(buffers) <= MAX_IOV:
            try:
                sent = self._sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.break_(f"send failed: {exc}")
                raise self._broken or TransportError(str(exc)) from None
            if sent == nbytes:
                return
            views = skip_bytes([memoryview(b) for b in buffers if len(b)], sent)
        else:
            views = [memoryview(b) for b in buffers if len(b)]
        if when is None:
            await self._send_rest(views)
            return
        async with deadline(when.remaining_s(), when.what):
            await self._send_rest(views)

    async def _send_rest(self, views: list[memoryview]) -> None:
        self._num_senders += 1
        try:
            async with self._send_lock:
                self.check()
                try:
                    await send_buffers(self._sock, views)
                except OSError as exc:
                    self.break_(f"send failed: {exc}")
                    self.check()
                except BaseException:
                    self.break_("send interrupted midway (deadline or cancellation)")
                    raise
        finally:
            self._num_senders -= 1

    async def request(self, header: Header, meta: bytes = b"") -> Reply:
        """Send a single frame with meta and wait for its reply (the caller bounds this)."""
        if header.meta_len != len(meta):
            header = dataclasses.replace(header, meta_len=len(meta))
        return await self.call(header.seq, [pack(header), meta], HEADER_BYTES + len(meta))

    async def call(
        self, seq: int, buffers: Sequence[memoryview | bytes], nbytes: int, when: Deadline | None = None
    ) -> Reply:
        """Send one op's frames (numbered `seq`, `nbytes` in all) and wait for the reply, until `when`
        (None: the caller bounds this).

        The reply to a small op comes back within tens of microseconds, well before the event loop would
        wake this task for it, so the socket may be polled for it first (`spin.Spinner`: bounded, adaptive;
        only with one op in flight: with more, the others' replies keep the loop busy and spinning would
        stall them). The deadline is one timer per channel (`DeadlineWatch`), not a timeout per call.
        """
        future = self.expect(seq)
        try:
            await self.send(buffers, nbytes, when)
            if not future.done() and len(self._pending) == 1 and self.spinner.budget_s:
                self._spin_for(future)
            if not future.done() and when is not None:
                self._deadlines.watch(seq, when)
            return await future  # a done future returns at once, without a trip through the loop
        finally:
            self._pending.pop(seq, None)
            self._deadlines.forget(seq)

    def _spin_for(self, future: asyncio.Future[Reply]) -> None:
        def replied() -> bool:  # one receive per try: the reply's arrival ends the poll without a dry read
            self._read_once()
            return future.done() or self._broken is not None

        self.spinner.poll(replied)

    # ------------------------------------------------------------------ replies
    def _on_readable(self) -> None:
        """Reader callback (registered for the channel's life): parse replies until the socket is dry."""
        while self._read_once():
            pass

    def _read_once(self) -> bool:
        """One receive into the reader; True when it brought bytes (more may be waiting)."""
        if self._broken is not None:
            return False
        try:
            nbytes = self._sock.recvmsg_into(self._reader.buffers())[0]
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self.break_(f"receive failed: {exc}")
            return False
        if nbytes == 0:
            if self._receiver_stopped:
                log.info("kv sender: KV receiver %s stopped and closed the connection", self.name)
            self.break_("connection closed by the receiver", quiet=self._receiver_stopped)
            return False
        try:
            self._reader.advance(nbytes)
        except KvpathError as exc:
            self.break_(f"bad reply: {exc.message}")
            return False
        return True

    def on_frame(self, header: Header, meta: bytes) -> None:
        if header.type is FrameType.BYE:  # the receiver is stopping: its close is no failure to warn of
            self._receiver_stopped = True
            return
        future = self._pending.pop(header.seq, None)
        if future is None or future.done():
            return  # the op gave up (deadline); its late reply is dropped
        if header.type is FrameType.ERROR:
            future.set_exception(_error_from_meta(meta))
        else:
            future.set_result((header, meta))

    def on_write_begin(self, header: Header, extents: np.ndarray, meta: bytes) -> list[memoryview] | None:
        raise TransportError("receiver sent a WRITE frame")  # excluded by RECEIVER_TYPES; never called

    def on_write_end(self, header: Header, meta: bytes) -> None:
        raise TransportError("receiver sent a WRITE frame")

    # ------------------------------------------------------------------ teardown
    def break_(self, reason: str, *, quiet: bool = False) -> None:
        """Mark broken and fail every op in flight. Idempotent."""
        if self._broken is not None:
            return
        self._broken = TransportError(f"connection to KV receiver {self.name} lost: {reason}")
        if not quiet:
            log.warning("kv sender: %s", self._broken.message)
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
        self._deadlines.stop()
        pending = list(self._pending.values())
        self._pending.clear()  # the same dict the deadline watch reads
        for future in pending:
            if not future.done():
                future.set_exception(self._broken)

    async def close(self, *, bye: bytes | None = None) -> None:
        """Optionally send a last frame (BYE), then close. Never raises."""
        if bye is not None and self._broken is None and not self._send_lock.locked():
            with contextlib.suppress(OSError, KvpathError):
                self._sock.send(bye)
        self.break_("closed by this sender", quiet=True)
        self._sock.close()


def _error_from_meta(meta: bytes) -> KvpathError:
    try:
        reply = decode(meta, ErrorReply)
    except KvpathError as exc:
        return TransportError(f"receiver sent an unreadable error: {exc.message}")
    return error_from_code(reply.code, reply.message, reply.param)

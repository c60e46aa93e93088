"""Incremental frame parser that tells the socket where the next bytes go (pure: no I/O).

The owner of a socket loops: `bufs = reader.buffers()`, `n = sock.recvmsg_into(bufs)`, `reader.advance(n)`.
Headers and metadata land in the reader's own small buffers; a WRITE's payload lands straight in the
memoryviews the sink returns for its extents (slices of a registered region), or in a scratch buffer
when the sink rejects the write. So payload bytes are never copied and never become `bytes` objects.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from shared.transport.wire import (
    HEADER_BYTES,
    FrameError,
    FrameType,
    Header,
    Limits,
    payload_bytes,
    unpack,
    unpack_extents,
)

MAX_IOV = 512  # buffers handed to one recvmsg_into (Linux IOV_MAX is 1024)
_SCRATCH_BYTES = 1 << 16


class FrameSink(Protocol):
    """What a reader calls. Exceptions it raises abort the reader (the connection is closed)."""

    def on_frame(self, header: Header, meta: bytes) -> None:
        """A frame without payload is complete."""

    def on_write_begin(self, header: Header, extents: np.ndarray, meta: bytes) -> list[memoryview] | None:
        """A WRITE's table and meta arrived: return one writable view per extent (its exact length), or
        None to have the payload read and dropped (the sink then answers with an error)."""

    def on_write_end(self, header: Header, meta: bytes) -> None:
        """Every payload byte of the WRITE begun last has arrived."""


class FrameReader:
    __slots__ = (
        "_allowed",
        "_filled",
        "_header",
        "_header_buf",
        "_idle_views",
        "_limits",
        "_meta",
        "_payload_left",
        "_scratch",
        "_sink",
        "_state",
        "_tail",
        "_targets",
    )

    def __init__(self, sink: FrameSink, limits: Limits, allowed: frozenset[FrameType]) -> None:
        self._sink = sink
        self._limits = limits
        self._allowed = allowed
        self._header_buf = bytearray(HEADER_BYTES)
        self._idle_views = [memoryview(self._header_buf)]  # between frames: built once, not per receive
        self._scratch: memoryview | None = None
        self._reset()

    def _reset(self) -> None:
        self._state = "header"
        self._filled = 0
        self._header: Header | None = None
        self._tail = bytearray()
        self._meta = b""
        self._targets: list[memoryview] = []
        self._payload_left = 0

    @property
    def is_idle(self) -> bool:
        """True between frames (a connection closing now loses no frame)."""
        return self._state == "header" and self._filled == 0

    @property
    def current(self) -> Header | None:
        """Header of the frame being read, if any."""
        return self._header

    def buffers(self) -> list[memoryview]:
        """Where the next received bytes must go, in order (never empty)."""
        if self._state == "header":
            filled = self._filled
            return self._idle_views if not filled else [self._idle_views[0][filled:]]
        if self._state == "tail":
            return [memoryview(self._tail)[self._filled :]]
        return self._targets[:MAX_IOV]

    def advance(self, nbytes: int) -> None:
        """`nbytes` were written into `buffers()`; consume them, calling the sink as frames complete."""
        if self._state == "payload":
            self._advance_payload(nbytes)
            return
        self._filled += nbytes
        if self._state == "header" and self._filled == HEADER_BYTES:
            self._on_header()
        elif self._state == "tail" and self._filled == len(self._tail):
            self._on_tail()

    def _on_header(self) -> None:
        header = unpack(self._header_buf, self._limits, self._allowed)
        tail_len = header.table_len + header.meta_len
        if tail_len:
            self._header = header
            self._state, self._filled, self._tail = "tail", 0, bytearray(tail_len)
        elif header.type is not FrameType.WRITE:  # a bare frame (an ack, a notice): done, nothing to reset
            self._filled = 0
            self._sink.on_frame(header, b"")
        else:
            self._header = header
            self._on_tail()

    def _on_tail(self) -> None:
        header = self._header
        assert header is not None
        table_len = header.table_len
        meta = self._meta = bytes(self._tail[table_len:])
        if header.type is not FrameType.WRITE:
            self._reset()
            self._sink.on_frame(header, meta)
            return
        table = unpack_extents(self._tail, header.aux) if header.aux else np.zeros((0, 2), np.uint64)
        if payload_bytes(table) != header.payload_len:
            raise FrameError(f"write seq={header.seq}: extent lengths do not add up to its payload length")
        targets = self._sink.on_write_begin(header, table, self._meta)
        self._payload_left = header.payload_len
        if targets is None:
            self._targets = []
        else:
            self._targets = [t for t in targets if len(t)]
            if sum(len(t) for t in self._targets) != header.payload_len:
                raise FrameError(f"write seq={header.seq}: sink returned views of the wrong total size")
        self._state = "payload"
        self._refill_scratch()
        if self._payload_left == 0:
            self._finish_write()

    def _refill_scratch(self) -> None:
        """In drop mode, point the next read at the scratch buffer."""
        if self._targets or not self._payload_left:
            return
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._targets = [self._scratch[: min(self._payload_left, _SCRATCH_BYTES)]]

    def _advance_payload(self, nbytes: int) -> None:
        self._payload_left -= nbytes
        targets = self._targets
        i = 0
        while nbytes and i < len(targets):
            size = len(targets[i])
            if nbytes >= size:
                nbytes -= size
                i += 1
            else:
                targets[i] = targets[i][nbytes:]
                nbytes = 0
        del targets[:i]
        if self._payload_left == 0:
            self._finish_write()
        else:
            self._refill_scratch()

    def _finish_write(self) -> None:
        header, meta = self._header, self._meta
        assert header is not None
        self._reset()
        self._sink.on_write_end(header, meta)

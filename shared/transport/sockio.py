"""Non-blocking socket helpers: gather-send straight from the callers' buffers, socket setup.

`send_buffers` hands the kernel a list of memoryviews per `sendmsg` (header, table, meta and payload views
in one call), so payload bytes go from the caller's array to the socket without a user-space copy.
Asyncio transports would copy whatever the kernel did not take at once into their own buffer.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

from shared.transport.reader import MAX_IOV


def as_bytes_view(data: Any) -> memoryview:
    """A flat byte view of any C-contiguous buffer (numpy array, bytes, memoryview), without copying."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if not view.c_contiguous:
        raise ValueError("source buffer must be C-contiguous")
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B")


async def wait_writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


async def send_buffers(sock: socket.socket, buffers: Sequence[memoryview]) -> int:
    """Send every byte of `buffers` in order; returns the byte count. Raises OSError on a broken socket.

    If cancelled midway the stream holds a partial frame: the caller must close the connection.
    """
    loop = asyncio.get_running_loop()
    views = [b for b in buffers if len(b)]
    total = sum(len(b) for b in views)
    i = 0
    while i < len(views):
        try:
            sent = sock.sendmsg(views[i : i + MAX_IOV])
        except (BlockingIOError, InterruptedError):
            await wait_writable(loop, sock)
            continue
        while sent:
            size = len(views[i])
            if sent >= size:
                sent -= size
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
    return total


def skip_bytes(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """`views` without their first `nbytes` bytes (what a short `sendmsg` already sent)."""
    i = 0
    while nbytes and i < len(views) and nbytes >= len(views[i]):
        nbytes -= len(views[i])
        i += 1
    rest = views[i:]
    if nbytes:
        rest[0] = rest[0][nbytes:]
    return rest


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """Non-blocking, no Nagle delay (notices are small), large kernel buffers for bulk payloads."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)

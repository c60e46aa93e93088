"""A streamed response's guard against a client that stops reading.

A client whose receive window stays shut (a hung agent, a proxy that stopped reading) blocks the response's
write once the kernel's buffers are full (a few MB on loopback). Without a guard the request then kept its
in-flight slot, its stream's tokens and the connection for as long as the client kept the socket open,
past its own deadline (the deadline's error event waits behind the blocked write) and through a drain. The
guard cuts the connection when one write has been pending `timeout_s`, as nginx's `send_timeout` does; the
handler's exit then aborts the request on its engines, as a client disconnect does.

One timer per stream, rearmed every quarter of the timeout; a write costs two stores.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from services.router import metrics

log = logging.getLogger(__name__)


class ClientStalledError(ConnectionResetError):
    """The client took no bytes of the stream for the write timeout; its connection was cut."""


class WriteGuard:
    def __init__(self, request: web.Request, response: web.StreamResponse, timeout_s: float, request_id: str):
        self._request = request
        self._response = response
        self._timeout_s = timeout_s
        self._request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._blocked_since: float | None = None  # when the pending write began; None: no write pending
        self.is_cut = False
        self._timer = self._loop.call_later(timeout_s / 4, self._check)

    async def write(self, chunk: bytes) -> None:
        self._begin()
        await self._response.write(chunk)
        self._end()

    async def write_eof(self) -> None:
        self._begin()
        await self._response.write_eof()
        self._end()

    def close(self) -> None:
        """Stop watching (the handler is done with the connection, which keep-alive may reuse)."""
        self._timer.cancel()

    def _begin(self) -> None:
        if self.is_cut:
            raise ClientStalledError(f"stream {self._request_id} cut: its client stopped reading")
        self._blocked_since = self._loop.time()

    def _end(self) -> None:
        self._blocked_since = None
        if self.is_cut:  # the cut wakes a pending write without an error
            raise ClientStalledError(f"stream {self._request_id} cut: its client stopped reading")

    def _check(self) -> None:
        since = self._blocked_since
        if since is not None and self._loop.time() - since >= self._timeout_s:
            self.is_cut = True
            metrics.STREAMS_STALLED.inc()
            log.warning(
                "stream cut request_id=%s: its client took no bytes for %.0fs",
                self._request_id,
                self._timeout_s,
            )
            if self._request.transport is not None:
                self._request.transport.abort()
            return
        self._timer = self._loop.call_later(self._timeout_s / 4, self._check)

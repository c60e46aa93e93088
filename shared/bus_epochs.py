"""Requests a NATS disconnect may have orphaned.

Core NATS request/reply is at most once: a request in flight when a service's connection drops may never be
answered (it, or its reply, went through a server that died, or the reply was published before the
requester's reply subscription was back after the reconnect). Such a request used to wait out its whole
timeout, which for a KV read is the request's deadline (600 s by default). Now every request belongs to the
connection epoch it was sent in; a disconnect ends the epoch, and its requests still unanswered `grace_s`
later are given up (the caller treats that as it treats an absent service: retry elsewhere, recompute, or
fail the request). A reply that comes back within the grace is still taken. Requests sent during or after the
outage belong to the next epoch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from shared import telemetry
from shared.errors import ServiceUnavailableError

T = TypeVar("T")
DEFAULT_GRACE_S = 10.0  # a reconnect takes ~0.5-2 s (nats-py's wait between attempts is 0.5 s)


class ReplyLostError(ServiceUnavailableError):
    """The request may have arrived and been acted on; its reply did not come back (the connection dropped).
    Unlike "no service answers" (nobody received it), a caller must not assume the request was not done."""


class ConnectionEpochs:
    """One future per connection epoch, resolved `grace_s` after the disconnect that ends it."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.grace_s = grace_s
        self._current: asyncio.Future[None] | None = None
        self.num_ended = 0

    def current(self) -> asyncio.Future[None]:
        """The epoch a request sent now belongs to: done once that request is to be given up."""
        if self._current is None:
            self._current = asyncio.get_running_loop().create_future()
        return self._current

    async def reply(self, subject: str, request: Coroutine[Any, Any, T]) -> T:
        """`request`'s result, unless the connection drops while it is in flight and no reply comes within
        the grace: then ServiceUnavailableError (the request is cancelled), not a wait to its timeout."""
        epoch = self.current()
        pending = asyncio.ensure_future(request)
        try:
            await asyncio.wait((pending, epoch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_up = not pending.done()
            if given_up:
                pending.cancel()
        if given_up:
            telemetry.BUS_ERRORS.labels("lost").inc()
            raise ReplyLostError(
                f"no reply on {subject}: the NATS connection dropped while the request was in flight"
                f" (given up {self.grace_s:.0f} s after)"
            )
        return pending.result()

    def disconnected(self) -> None:
        """The connection dropped: the requests in flight get `grace_s` for their replies."""
        ended, self._current = self._current, None
        self.num_ended += 1
        if ended is not None:
            asyncio.get_running_loop().call_later(self.grace_s, _give_up, ended)


def _give_up(epoch: asyncio.Future[None]) -> None:
    if not epoch.done():
        epoch.set_result(None)

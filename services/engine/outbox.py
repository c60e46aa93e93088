"""Where an engine's token deltas leave: one `TokenBatch` per router per step, and last deltas that wait.

A request's last delta may have to wait for its connector (blocks durable and indexed, the DONE notice to a
decode engine): the wait travels with the delta, which a background task publishes once the wait ends, so
the step loop never blocks on it. `close` gives those tasks a bounded time to finish.

Core NATS delivers at most once: a batch published across a server restart can be lost. The outbox keeps
what it sent of each request in the last `RETAIN_S` (an outage's worth: the router asks once its connection
is back, and a fast engine sends hundreds of deltas a second meanwhile), and `resend` gives it again to a
router that saw a gap or a silence in the stream (`TokenResend`); the router drops what it already has.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from shared.background import Background
from shared.protocol import TokenBatch, TokenDelta

log = logging.getLogger(__name__)

Publish = Callable[[str, TokenBatch], Awaitable[None]]
Outgoing = tuple[str, TokenDelta, Awaitable[None] | None]  # (router id, delta, what it waits for)

CLOSE_WAIT_S = 5.0
RETAIN_S = 15.0  # a request's deltas are kept this long after they were sent, for resends
RETAIN_DELTAS = 4096  # and at most its last this many (~0.4 KB each), whatever the step rate


class TokenOutbox:
    def __init__(self, engine_id: str, publish: Publish) -> None:
        self.engine_id = engine_id
        self.publish = publish
        self.step = 0
        self._background = Background()
        # request id -> (when sent (monotonic), delta), oldest first; requests quietest first
        self._sent: OrderedDict[str, deque[tuple[float, TokenDelta]]] = OrderedDict()

    def resend(self, request_id: str, from_seq: int) -> list[TokenDelta]:
        """The request's deltas from `from_seq` on, as sent (none when it is unknown or quiet too long)."""
        return [d for _, d in self._sent.get(request_id, ()) if d.seq >= from_seq]

    def _keep(self, deltas: list[TokenDelta]) -> None:
        now = time.monotonic()
        for delta in deltas:
            sent = self._sent.get(delta.request_id)
            if sent is None:
                sent = self._sent[delta.request_id] = deque(maxlen=RETAIN_DELTAS)
            sent.append((now, delta))
            while now - sent[0][0] > RETAIN_S:
                sent.popleft()
            self._sent.move_to_end(delta.request_id)
        while self._sent and now - next(iter(self._sent.values()))[-1][0] > RETAIN_S:
            self._sent.popitem(last=False)

    def run_detached(self, wait: Awaitable[None] | None) -> None:
        """A wait whose delta is never sent (nobody expects one) still runs to completion."""
        if wait is not None:
            self.spawn(_await(wait))

    async def flush(self, out: list[Outgoing]) -> None:
        by_router: dict[str, list[TokenDelta]] = defaultdict(list)
        for router_id, delta, wait in out:
            if wait is None:
                by_router[router_id].append(delta)
            else:
                self.spawn(self._publish_after(wait, router_id, delta))
        for router_id, deltas in by_router.items():
            await self._publish(router_id, deltas)

    async def _publish(self, router_id: str, deltas: list[TokenDelta]) -> None:
        batch = TokenBatch(engine_id=self.engine_id, step=self.step, deltas=deltas)
        self._keep(deltas)
        try:
            await self.publish(router_id, batch)
        except Exception as exc:  # the router notices the gap or the silence
            log.warning("token publish failed router=%s: %r", router_id, exc)

    async def _publish_after(self, wait: Awaitable[None], router_id: str, delta: TokenDelta) -> None:
        try:
            await wait
        except Exception:
            log.exception(
                "finish wait failed request_id=%s", delta.request_id, extra={"request_id": delta.request_id}
            )
        await self._publish(router_id, [delta])

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._background.keep(coro)

    async def close(self) -> None:
        await self._background.close(grace_s=CLOSE_WAIT_S)


async def _await(wait: Awaitable[None]) -> None:
    await wait

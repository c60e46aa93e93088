"""Token batches NATS lost, asked for again.

Core NATS delivers at most once: a nats-server restart (or a clustered server lost) can drop token batches in
flight. A stream that then has a gap (a later delta came, an earlier one did not) or falls silent (its last
deltas, maybe its finish, never came) would fail with `engine_failed` once the gap expires, or wait until
its deadline. Every watch period the router asks the engines serving such a stream for its deltas from the
one it expects (`TokenResend`; each engine keeps what it sent of a request for a while,
`services/engine/outbox.py`), and delivers the reply as if it had come on the token subject: the stream
table drops what it already has. A gap the engines cannot fill still fails when it expires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from services.router import metrics
from services.router.streams import StreamTable
from shared.bus import Bus
from shared.errors import KvpathError
from shared.protocol import TokenBatch, TokenResend

log = logging.getLogger(__name__)

GAP_PROBE_S = 0.5  # a gap this old is not a PE -> DE hand-off reordering (milliseconds) any more
RESEND_TIMEOUT_S = 2.0


class StreamResends:
    def __init__(
        self,
        bus: Bus,
        streams: StreamTable,
        silent_s: float,
        spawn: Callable[[Coroutine[Any, Any, None], str], Any],
    ) -> None:
        self.bus = bus
        self.streams = streams
        self.silent_s = silent_s  # a stream without a new delta this long is asked about
        self.spawn = spawn  # the service's: its stop cancels asks in flight

    def tick(self, now: float) -> int:
        """Ask about every stream due; return how many asks went out."""
        asks = 0
        for task_id, from_seq, engine_ids in self.streams.to_probe(
            now, gap_s=GAP_PROBE_S, silent_s=self.silent_s
        ):
            for engine_id in engine_ids:
                self.spawn(self._ask(engine_id, task_id, from_seq), "token-resend")
                asks += 1
        return asks

    async def _ask(self, engine_id: str, task_id: str, from_seq: int) -> None:
        try:
            batch = await self.bus.request(
                self.bus.subjects.resend(engine_id),
                TokenResend(request_id=task_id, from_seq=from_seq),
                TokenBatch,
                timeout_s=RESEND_TIMEOUT_S,
            )
        except KvpathError as exc:  # the engine is gone or busy: the gap expires, or silence fails it
            log.debug("token resend failed request_id=%s engine=%s: %s", task_id, engine_id, exc.message)
            return
        finally:
            self.streams.answered(task_id)
        if batch.deltas:
            delivered = self.streams.deliver(batch, time.monotonic())
            metrics.TOKENS_RESENT.inc(delivered)
            if delivered:
                log.info(
                    "token batch resent request_id=%s engine=%s deltas=%d", task_id, engine_id, delivered
                )

"""The index's view of the KV-events stream: an ephemeral pull consumer from a given stream sequence.

Ordered by stream sequence, no acks (the index tracks its own position: `applied_stream_seq`). After a
NATS outage or a lost consumer the feed is reopened from the last applied sequence + 1, so nothing is
skipped; replays of what was already applied are no-ops in the index.
"""

from __future__ import annotations

import contextlib
import logging

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.bus import Bus

log = logging.getLogger(__name__)

_INACTIVE_THRESHOLD_S = 60.0

FeedErrors = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)
_NOTHING = (nats.errors.TimeoutError, TimeoutError)  # nats-py raises either when nothing arrived


class EventFeed:
    def __init__(self, bus: Bus, stream: str, *, fetch_batch: int, fetch_wait_s: float) -> None:
        self.bus = bus
        self.stream = stream
        self.fetch_batch = fetch_batch
        self.fetch_wait_s = fetch_wait_s
        self._sub: JetStreamContext.PullSubscription | None = None

    async def open(self, start_seq: int) -> None:
        """(Re)create the consumer so the next fetch starts at stream sequence `start_seq`."""
        await self.close()
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, start_seq),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=_INACTIVE_THRESHOLD_S,
            mem_storage=True,
            num_replicas=1,
        )
        self._sub = await self.bus.js.pull_subscribe(
            self.bus.subjects.kv_events_all, stream=self.stream, config=config
        )

    async def fetch(self) -> list[Msg]:
        """The next batch of messages in stream order, returned as soon as the first one arrives (with
        every one already waiting behind it, up to `fetch_batch`); [] when none arrived within
        `fetch_wait_s`.

        Not one `fetch(fetch_batch)`: after a window that ended empty, nats-py's batch fetch can take
        the expired pull request's late 408 for the answer to its own probe and send a lingering pull
        for the whole batch that outlives it; the next event then goes to that pull, and the fetch
        that receives it waits for the rest of the batch until the pull expires (up to `fetch_wait_s`,
        and every request whose last delta waits for its blocks to be indexed waits with it). A pull
        for one message cannot hold a second one back. The first message carries how many more the
        consumer holds (`num_pending`); those are fetched at once, without lingering."""
        if self._sub is None:
            raise nats.errors.Error("event feed not open")
        try:
            msgs = await self._sub.fetch(1, timeout=self.fetch_wait_s)
        except _NOTHING:
            return []
        waiting = min(self.fetch_batch - 1, int(msgs[-1].metadata.num_pending or 0))
        if waiting > 0:  # delivered is delivered (no acks): a timeout here must not lose the first
            with contextlib.suppress(*_NOTHING):
                msgs += await self._sub.fetch(waiting, timeout=self.fetch_wait_s)
        return msgs

    async def num_pending(self) -> int:
        """Messages the consumer has not delivered yet (raises when the consumer is gone)."""
        if self._sub is None:
            raise nats.errors.Error("event feed not open")
        info = await self._sub.consumer_info()
        return int(info.num_pending or 0)

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(*FeedErrors):
                await sub.unsubscribe()


def stream_seq_of(msg: Msg) -> int:
    return int(msg.metadata.sequence.stream)

"""The metadata index service: KV events in (JetStream), `index.match` / `index.stats` out.

Start: load the snapshot (if `data_dir` has one), create the KV-events stream if missing, replay the
stream from the snapshot's sequence + 1 until caught up with where the stream stood at start, and only
then subscribe to `index.match`, so a restarted index answers exactly as before. Then it tails the
stream. Every `snapshot_every_events` messages, or `snapshot_every_s` after the last snapshot when messages
came, it writes a snapshot and purges the messages the snapshot covers, keeping the stream short (nats-server
holds some KB of memory per stored message, so an unpurged stream grows its RSS without bound); restart =
snapshot + replay of the rest.

Snapshots live in a local file, so with several index replicas only one should purge (or they share
`data_dir`); a replica started without the snapshot after a purge starts from what is left in the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from services.index import metrics, snapshot
from services.index.config import IndexConfig
from services.index.feed import EventFeed, FeedErrors, stream_seq_of
from services.index.handlers import IndexHandlers
from services.index.index import BlockIndex
from shared.errors import ProtocolError, ServiceUnavailableError
from shared.kvclient import ensure_kv_events_stream
from shared.protocol import decode
from shared.protocol.kv import KV_EVENT_TYPES, IndexMatchRequest, IndexStats, IndexStatsRequest
from shared.service import Service

log = logging.getLogger(__name__)

_FEED_CHECK_S = 5.0


class IndexService(Service):
    service_kind = "index"

    def __init__(self, config: IndexConfig) -> None:
        super().__init__(config)
        self.config: IndexConfig = config
        self.index = BlockIndex(config.initial_capacity)
        self.snapshot_path = Path(config.data_dir) / snapshot.SNAPSHOT_NAME if config.data_dir else None
        self.snapshot_stream_seq = 0
        self.num_malformed_events = 0
        self._since_snapshot = 0
        self._snapshot_at = time.monotonic()
        self._stream = ""
        self._feed: EventFeed | None = None
        metrics.bind_index(self)

    @property
    def feed(self) -> EventFeed:
        assert self._feed is not None, "index service not started"
        return self._feed

    async def on_start(self) -> None:
        self._load_snapshot()
        self._stream = await ensure_kv_events_stream(self.bus, max_bytes=self.config.stream_max_bytes)
        self._feed = EventFeed(
            self.bus, self._stream, fetch_batch=self.config.fetch_batch, fetch_wait_s=self.config.fetch_wait_s
        )
        await self._catch_up()
        handlers = IndexHandlers(self.index, self.config, self.stats)
        await self.bus.subscribe(self.bus.subjects.index_match, IndexMatchRequest, handlers.match)
        await self.bus.subscribe(self.bus.subjects.index_stats, IndexStatsRequest, handlers.stats)
        self.spawn(self._tail(), "tail-events")

    def _load_snapshot(self) -> None:
        if self.snapshot_path is None:
            return
        try:
            loaded = snapshot.load(self.snapshot_path)
        except ValueError as exc:  # a bad snapshot: start from the stream alone
            log.error("%s; ignoring it", exc)
            return
        if loaded is not None:
            self.index = BlockIndex.restore(*loaded)
            self.snapshot_stream_seq = self.index.applied_stream_seq
            log.info(
                "index snapshot loaded blocks=%d stream_seq=%d", len(self.index), self.snapshot_stream_seq
            )

    async def _catch_up(self) -> None:
        """Replay the stream up to where it stood when we started (bounded by replay_timeout_s)."""
        info = await self.bus.js.stream_info(self._stream)
        last_seq = int(info.state.last_seq)
        if self.index.applied_stream_seq > last_seq:
            log.warning(
                "stream %s ends at %d, before the snapshot's %d: it was recreated; replaying it all",
                self._stream, last_seq, self.index.applied_stream_seq,
            )  # fmt: skip
            self.index.applied_stream_seq = 0
        started = time.monotonic()
        await self.feed.open(self.index.applied_stream_seq + 1)
        while self.index.applied_stream_seq < last_seq:
            if time.monotonic() - started > self.config.replay_timeout_s:
                raise ServiceUnavailableError(f"index replay did not reach stream seq {last_seq} in time")
            msgs = await self.feed.fetch()
            if not msgs and await self.feed.num_pending() == 0:
                break  # the rest was purged or deleted
            self._apply(msgs)
        log.info(
            "index caught up blocks=%d stream_seq=%d in %.2fs",
            len(self.index), self.index.applied_stream_seq, time.monotonic() - started,
        )  # fmt: skip

    async def _tail(self) -> None:
        backoff_s = 0.1
        last_check = time.monotonic()
        while True:
            try:
                msgs = await self.feed.fetch()
                if not msgs and time.monotonic() - last_check > _FEED_CHECK_S:
                    last_check = time.monotonic()
                    await self.feed.num_pending()  # raises when the consumer is gone
            except FeedErrors as exc:
                log.warning(
                    "KV event feed failed (%r); reopening at seq %d", exc, self.index.applied_stream_seq + 1
                )
                await asyncio.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, 2.0)
                try:
                    await self.feed.open(self.index.applied_stream_seq + 1)
                except FeedErrors as reopen_exc:
                    log.warning("reopening the KV event feed failed: %r", reopen_exc)
                continue
            backoff_s = 0.1
            self._apply(msgs)
            if self._is_snapshot_due():
                await self.take_snapshot(purge=self.config.purge_after_snapshot)

    def _is_snapshot_due(self) -> bool:
        if self.snapshot_path is None or self._since_snapshot == 0:
            return False
        every_s = self.config.snapshot_every_s
        is_old = every_s > 0 and time.monotonic() - self._snapshot_at >= every_s
        return is_old or self._since_snapshot >= self.config.snapshot_every_events

    def _apply(self, msgs: list[Msg]) -> None:
        applied, ignored = self.index.num_events_applied, self.index.num_events_ignored
        malformed = self.num_malformed_events
        for msg in msgs:
            seq = stream_seq_of(msg)
            self._since_snapshot += 1
            try:
                event = decode(msg.data, KV_EVENT_TYPES)
                self.index.apply(event, seq)
            except (ProtocolError, ValueError, OverflowError) as exc:
                self.num_malformed_events += 1
                self.index.applied_stream_seq = max(self.index.applied_stream_seq, seq)
                log.warning("malformed KV event stream_seq=%d subject=%s: %s", seq, msg.subject, exc)
        metrics.EVENTS_APPLIED.inc(self.index.num_events_applied - applied)
        metrics.EVENTS_IGNORED.inc(self.index.num_events_ignored - ignored)
        metrics.EVENTS_MALFORMED.inc(self.num_malformed_events - malformed)

    async def take_snapshot(self, *, purge: bool) -> int:
        """Write a snapshot (and purge the stream up to it); return the stream seq it covers (0: none)."""
        if self.snapshot_path is None:
            return 0
        arrays, meta = self.index.snapshot()
        seq = self.index.applied_stream_seq
        loop = asyncio.get_running_loop()
        size = await loop.run_in_executor(None, snapshot.save, self.snapshot_path, arrays, meta)
        self.snapshot_stream_seq = seq
        self._since_snapshot = 0
        self._snapshot_at = time.monotonic()
        log.info("index snapshot written blocks=%d stream_seq=%d bytes=%d", len(self.index), seq, size)
        if purge and seq > 0:
            try:
                await self.bus.js.purge_stream(self._stream, seq=seq + 1)
            except FeedErrors as exc:
                log.warning("stream purge after snapshot failed: %r", exc)
        return seq

    async def on_stop(self) -> None:
        if self.config.snapshot_on_stop and self.snapshot_path is not None and self._feed is not None:
            try:
                await self.take_snapshot(purge=self.config.purge_after_snapshot)
            except OSError as exc:
                log.error("snapshot on stop failed: %r", exc)
        if self._feed is not None:
            await self._feed.close()

    def stats(self) -> IndexStats:
        return IndexStats(
            service_id=self.service_id,
            num_blocks=len(self.index),
            table_bytes=self.index.nbytes,
            applied_stream_seq=self.index.applied_stream_seq,
            snapshot_stream_seq=self.snapshot_stream_seq,
            num_events_applied=self.index.num_events_applied,
            num_events_ignored=self.index.num_events_ignored,
            locations=self.index.live_locations(),
        )

    def health(self) -> dict[str, Any]:
        out = super().health()
        out.update(blocks=len(self.index), applied_stream_seq=self.index.applied_stream_seq)
        return out

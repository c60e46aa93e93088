"""Per-request token streams on the router: ordering, gap detection, failure fan-out.

Engines publish one `TokenBatch` per step; `StreamTable.deliver` routes each delta to its request's queue in
sequence order. A missing sequence number (a lost message) fails that request with a clear error rather than
silently dropping tokens; a duplicate is ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass, field

from shared.errors import EngineFailedError, KvpathError
from shared.protocol import TokenBatch, TokenDelta

log = logging.getLogger(__name__)

StreamItem = TokenDelta | KvpathError


@dataclass(slots=True)
class RequestStream:
    request_id: str
    engine_ids: set[str] = field(default_factory=set)  # engines whose failure fails the stream
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    next_seq: int = 0
    is_finished: bool = False

    def put_error(self, error: KvpathError) -> None:
        if not self.is_finished:
            self.is_finished = True
            self.queue.put_nowait(error)


class StreamTable:
    """Open streams by request id and by engine."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._by_engine: dict[str, set[str]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, engine_id: str = "") -> RequestStream:
        """Open a stream; tokens are accepted at once, even before an engine is assigned."""
        stream = RequestStream(request_id=request_id)
        self._streams[request_id] = stream
        if engine_id:
            self.assign(request_id, engine_id)
        return stream

    def assign(self, request_id: str, engine_id: str) -> None:
        """Record an engine serving the stream (its failure then fails the stream)."""
        self._streams[request_id].engine_ids.add(engine_id)
        self._by_engine[engine_id].add(request_id)

    def unassign(self, request_id: str, engine_id: str) -> None:
        """The engine handed the request off: its failure no longer concerns the stream."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.engine_ids.discard(engine_id)
        ids = self._by_engine.get(engine_id)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self._by_engine[engine_id]

    def close(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            for engine_id in list(stream.engine_ids):
                self.unassign(request_id, engine_id)

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def deliver(self, batch: TokenBatch) -> int:
        """Route a batch's deltas; return how many reached an open stream."""
        delivered = 0
        for delta in batch.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None or stream.is_finished:
                continue  # aborted or already failed: late tokens are dropped
            if delta.seq < stream.next_seq:
                continue  # duplicate
            if delta.seq > stream.next_seq:
                log.warning(
                    "token gap request_id=%s expected=%d got=%d engine=%s",
                    delta.request_id,
                    stream.next_seq,
                    delta.seq,
                    batch.engine_id,
                )
                stream.put_error(
                    EngineFailedError(
                        f"token stream gap from engine {batch.engine_id}: expected delta {stream.next_seq}, "
                        f"got {delta.seq}"
                    )
                )
                continue
            stream.next_seq += 1
            if delta.handoff:
                self.unassign(delta.request_id, batch.engine_id)
            if delta.finish_reason is not None:
                stream.is_finished = True
            stream.queue.put_nowait(delta)
            delivered += 1
        return delivered

    def fail_engine(self, engine_id: str, error: KvpathError) -> int:
        """Fail every open stream served by `engine_id` (it died or stopped answering)."""
        ids = list(self._by_engine.get(engine_id, ()))
        for request_id in ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_error(error)
        return len(ids)

    def engines_with_streams(self) -> list[str]:
        return list(self._by_engine)

"""Per-request token streams on the router: ordering, gap detection, failure fan-out.

Engines publish one `TokenBatch` per step; `StreamTable.deliver` routes each delta to its request's queue in
sequence order. A missing sequence number (a lost message) fails that request with a clear error rather than
silently dropping tokens; a duplicate is ignored. A dispatch that retries a request sends the new attempt
under its own id (`retarget`): engines then know the request by that id, and the failed attempt's deltas are
dropped. A stream whose attempt was lost before any token reached the client (an engine's death:
`lost_engine`) may be `restart`ed: the router dispatches the request again (`RouterCore`), and the client
never sees the loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

from shared.errors import EngineFailedError, KvpathError
from shared.protocol import TokenBatch, TokenDelta

log = logging.getLogger(__name__)

StreamItem = TokenDelta | KvpathError
CLOSED_KEPT = 4096


@dataclass(slots=True)
class RequestStream:
    request_id: str
    engine_ids: set[str] = field(default_factory=set)  # engines whose failure fails the stream
    assigned_unix_s: dict[str, float] = field(default_factory=dict)  # engine -> when it took the request
    held: dict[int, tuple[TokenDelta, str, float]] = field(default_factory=dict)  # ahead of next_seq
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    next_seq: int = 0
    is_finished: bool = False
    choice_ids: list[str] = field(default_factory=list)  # choice 0's: the other choices of its one task
    task_ids: list[str] = field(default_factory=list)  # the engines' ids of it, the live attempt's last
    lost_engine: str = ""  # the engine whose death or restart failed the stream (`fail_engine`)
    progress_at: float = field(default_factory=time.monotonic)  # opened, or its last delta delivered
    probed_at: float = 0.0  # its engines were last asked to send its deltas again (resend.py)
    asks: int = 0  # of those asks, how many are unanswered yet

    def put_error(self, error: KvpathError) -> None:
        if not self.is_finished:
            self.is_finished = True
            self.queue.put_nowait(error)


class StreamTable:
    """Open streams by request id and by engine."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._by_engine: dict[str, set[str]] = defaultdict(set)
        self._by_task: dict[str, str] = {}  # a retried attempt's id -> its request's id
        self.unknown: set[str] = set()  # ids of unfinished deltas no stream took (`orphans.py` aborts them)
        self._closed: OrderedDict[str, None] = OrderedDict()  # the last CLOSED_KEPT ids closed here
        self.ended: KvpathError | None = None  # `end_all`'s error: streams opened after it fail with it

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, engine_id: str = "") -> RequestStream:
        """Open a stream; tokens are accepted at once, even before an engine is assigned."""
        if self.ended is not None:
            raise self.ended
        stream = RequestStream(request_id=request_id, task_ids=[request_id])
        self._streams[request_id] = stream
        if engine_id:
            self.assign(request_id, engine_id)
        return stream

    def retarget(self, request_id: str, task_id: str) -> None:
        """A retried dispatch sends the request under `task_id`: take its deltas, drop the earlier attempts'
        (an abort for an attempt names its id, so it never stops the next one); by either id."""
        request_id = self._by_task.get(request_id, request_id)
        self._streams[request_id].task_ids.append(task_id)
        self._by_task[task_id] = request_id

    def restart(self, request_id: str, task_id: str) -> None:
        """The request goes out again under `task_id` after the attempt serving it was lost before any token
        reached the client: the engines of that attempt no longer concern it, its failure is undone, the new
        attempt's deltas count from 0."""
        stream = self._streams[request_id]
        for engine_id in list(stream.engine_ids):
            self.unassign(request_id, engine_id)
        stream.lost_engine = ""
        stream.choice_ids = []  # choices of a lost task go on alone
        stream.next_seq = 0
        stream.is_finished = False
        stream.held.clear()
        stream.queue = asyncio.Queue()
        self.retarget(request_id, task_id)

    def assign(self, request_id: str, engine_id: str) -> None:
        """Record an engine serving the stream (its failure then fails the stream); by either id."""
        request_id = self._by_task.get(request_id, request_id)
        stream = self._streams[request_id]
        stream.engine_ids.add(engine_id)
        stream.assigned_unix_s[engine_id] = time.time()
        self._by_engine[engine_id].add(request_id)

    def unassign(self, request_id: str, engine_id: str) -> None:
        """The engine handed the request off: its failure no longer concerns the stream."""
        request_id = self._by_task.get(request_id, request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.engine_ids.discard(engine_id)
        ids = self._by_engine.get(engine_id)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self._by_engine[engine_id]

    def close(self, request_id: str) -> list[str]:
        """Drop the stream; return the ids the engines know it by (an abort names each)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return [request_id]
        for engine_id in list(stream.engine_ids):
            self.unassign(request_id, engine_id)
        for task_id in stream.task_ids[1:]:
            del self._by_task[task_id]
        for task_id in stream.task_ids:  # their late deltas are not orphans: the close aborted them
            self._closed[task_id] = None
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)
        return stream.task_ids

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def deliver(self, batch: TokenBatch, now: float = 0.0) -> int:
        """Route a batch's deltas in sequence order; return how many reached an open stream.

        A delta ahead of the next expected one is held: after a hand-off (PE -> DE) the two engines'
        messages may arrive out of order. One that stays missing is a gap (`expire_gaps`).
        """
        delivered = 0
        for delta in batch.deltas:
            stream = self._streams.get(self._by_task.get(delta.request_id, delta.request_id))
            if stream is None:
                if delta.finish_reason is None and delta.request_id not in self._closed:
                    self.unknown.add(delta.request_id)
                continue
            if stream.is_finished or delta.seq < stream.next_seq:
                continue  # aborted, failed, or a duplicate: dropped
            if delta.request_id != stream.task_ids[-1]:
                continue  # an attempt the dispatch gave up on
            if delta.seq > stream.next_seq:
                stream.held[delta.seq] = (delta, batch.engine_id, now)
                continue
            delivered += self._push(stream, delta, batch.engine_id)
            while stream.next_seq in stream.held and not stream.is_finished:
                held, engine_id, _ = stream.held.pop(stream.next_seq)
                delivered += self._push(stream, held, engine_id)
        return delivered

    def _push(self, stream: RequestStream, delta: TokenDelta, engine_id: str) -> int:
        stream.next_seq += 1
        stream.progress_at = time.monotonic()
        if delta.handoff:  # the PE is done with the request: with every choice of it (a DE forks them)
            for request_id in [delta.request_id, *stream.choice_ids]:
                self.unassign(request_id, engine_id)
        if delta.finish_reason is not None:
            stream.is_finished = True
        stream.queue.put_nowait(delta)
        return 1

    def to_probe(self, now: float, *, gap_s: float, silent_s: float) -> list[tuple[str, int, list[str]]]:
        """(task id, the delta it expects, its engines) of each open stream whose engines are asked to send
        its deltas again (a batch NATS lost): a gap older than `gap_s`, or no delta for `silent_s`; each
        stream at most once per that time, and not while it waits for an answer (`answered`)."""
        due = []
        for stream in self._streams.values():
            if stream.is_finished or not stream.engine_ids or stream.asks:
                continue
            if stream.held:
                since = max(min(stream.held.items())[1][2], stream.probed_at)
                is_due = now - since > gap_s
            else:
                is_due = now - max(stream.progress_at, stream.probed_at) > silent_s
            if is_due:
                stream.probed_at = now
                stream.asks = len(stream.engine_ids)
                due.append((stream.task_ids[-1], stream.next_seq, sorted(stream.engine_ids)))
        return due

    def answered(self, task_id: str) -> None:
        """One engine answered (or failed to answer) an ask `to_probe` gave out for the stream."""
        stream = self._streams.get(self._by_task.get(task_id, task_id))
        if stream is not None and stream.asks:
            stream.asks -= 1

    def expire_gaps(self, now: float, window_s: float, ask_wait_s: float = 0.0) -> int:
        """Fail streams whose missing delta did not arrive within `window_s` of a later one (lost); one whose
        engines are being asked for it gets up to `ask_wait_s` more for their answer."""
        failed = 0
        for stream in self._streams.values():
            if not stream.held or stream.is_finished:
                continue
            seq, (_, engine_id, held_at) = min(stream.held.items())
            if now - held_at > window_s + (ask_wait_s if stream.asks else 0.0):
                log.warning(
                    "token gap request_id=%s expected=%d got=%d engine=%s",
                    stream.request_id,
                    stream.next_seq,
                    seq,
                    engine_id,
                    extra={"request_id": stream.request_id},
                )
                stream.put_error(
                    EngineFailedError(
                        f"token stream gap: delta {stream.next_seq} never arrived "
                        f"(delta {seq} from {engine_id} did)"
                    )
                )
                failed += 1
        return failed

    def fail_engine(self, engine_id: str, error: KvpathError, *, assigned_before: float | None = None) -> int:
        """Fail every open stream served by `engine_id` (it died or stopped answering); with
        `assigned_before` (unix s) only those it took before then (a restarted engine's old process)."""
        failed = 0
        for request_id in list(self._by_engine.get(engine_id, ())):
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if assigned_before is not None and stream.assigned_unix_s.get(engine_id, 0.0) >= assigned_before:
                continue
            if stream.is_finished:
                continue  # failed already (an earlier sweep, or its error is queued): counted then
            stream.lost_engine = engine_id
            stream.put_error(error)
            failed += 1
        return failed

    def end_all(self, error: KvpathError) -> int:
        """End every open stream with `error`, and every stream opened from now on (the router stops)."""
        self.ended = error
        ended = 0
        for stream in self._streams.values():
            if not stream.is_finished:
                stream.put_error(error)
                ended += 1
        return ended

    def engines_with_streams(self) -> list[str]:
        return list(self._by_engine)

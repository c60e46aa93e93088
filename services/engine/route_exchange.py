"""The requester's per-layer route exchanges, one per holder and layer for a whole forward.

The runtime's worker thread calls `RouteSession.send` for every routed sequence of a forward, which only
queues the sequence's query rows here, then `flush` once the layer's sends are queued (the runtime's
`PrefixAttention.flush`; a `receive` flushes too, so a caller that does not cannot hang). Each holder's
queries go out as one group (shared/protocol/movequery.py): one write of every request's rows into its own
extent of the holder's query region with one notice on the first request's tag, and the holder answers the
group with one attention call and one write. The reply resolves each request's future with a view of its
partial in this engine's reply region (no copy). A group that fails, is late or is refused as a whole fails
the future of each of its requests; an item the holder refused fails only its own. Each request then falls
back on its own (route_session.py), with the tokens it would have produced anyway.

A message per group instead of per request is what keeps many routed sub-agents on one engine from costing
a message, two thread hops and a task per request, layer and step on both ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from services.engine import metrics
from shared.errors import KvpathError, TransportError
from shared.protocol import decode, encode
from shared.protocol.movequery import PartialQueries, PartialQuery, PartialReplies

REPLY_REGION = "mq_replies"


@dataclass(slots=True)
class Query:
    """One routed request's rows for one layer, waiting for its group's round trip."""

    session: Any  # the RouteSession (its ctx, opened session, peer, slot and reply offset)
    item: PartialQuery
    rows: memoryview
    future: concurrent.futures.Future[np.ndarray]


ROUTE_STEP_TTL_S = 30.0  # a routed step measured longer ago than this no longer prices routes


class StepMeter:
    """A moving average of how long a decoding forward with routed requests waited for their partials (the
    worker thread blocked on them, summed over the layers), for the load report
    (`RouteCapability.route_step_s`). Every routed request of the forward waits that long: it is what a
    route costs a step here, thread hops and the host's load included. Reads 0 once no step was measured
    for `ttl_s`, so a route is priced by the model again after a quiet spell (and measured)."""

    __slots__ = ("_at", "_ttl_s", "_value", "_weight")

    def __init__(self, weight: float = 0.2, ttl_s: float = ROUTE_STEP_TTL_S) -> None:
        self._weight, self._ttl_s = weight, ttl_s
        self._value = self._at = 0.0

    def add(self, step_s: float) -> None:
        if step_s > 0:
            w = self._weight if self._value else 1.0
            self._value, self._at = (1 - w) * self._value + w * step_s, time.monotonic()

    @property
    def value(self) -> float:
        return self._value if time.monotonic() - self._at <= self._ttl_s else 0.0


class RouteExchanges:
    """The queries queued since the last flush, by holder. Thread-safe: the worker thread queues and flushes,
    the event loop resolves. It also times the forwards' waits for their partials (`steps`): a flush of
    layer-0 queries starts a forward, which is a decoding one when every routed request sends one token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, str], list[Query]] = {}
        self.steps = StepMeter()
        self._stall_s = 0.0  # the current forward's waits so far (worker thread only)
        self._decoding = False

    def stalled(self, seconds: float) -> None:
        """The worker thread waited `seconds` for a partial (a receive)."""
        self._stall_s += seconds

    def add(self, query: Query) -> None:
        queries = query.session.opened.queries
        key = (queries.engine_id, queries.region, query.session.opened.sender_id)
        with self._lock:
            self._pending.setdefault(key, []).append(query)

    def flush(self) -> None:
        """Send every queued group (a no-op when nothing is queued)."""
        with self._lock:
            groups, self._pending = self._pending, {}
        items = [q.item for queries in groups.values() for q in queries]
        if any(item.layer == 0 for item in items):  # a new forward: the last one's waits are complete
            if self._decoding:
                self.steps.add(self._stall_s)
            self._stall_s, self._decoding = 0.0, all(item.num_tokens == 1 for item in items)
        for queries in groups.values():
            asyncio.run_coroutine_threadsafe(exchange(queries), queries[0].session.loop)


async def exchange(queries: list[Query]) -> None:
    """One group's round trip; every query's future is resolved or failed when it returns."""
    try:
        await _round_trip(queries)
    except Exception as exc:  # cut off, late, refused or garbled: each request falls back on its own
        failure = exc if isinstance(exc, KvpathError) else TransportError(f"route exchange failed: {exc!r}")
        for query in queries:
            if not query.future.done():
                query.future.set_exception(failure)


async def _round_trip(queries: list[Query]) -> None:
    lead = queries[0].session
    ctx, opened = lead.ctx, lead.opened
    started = time.perf_counter()
    items = [q.item for q in queries]
    extents = [(q.session.opened.queries.offset, q.rows) for q in queries]
    meta = encode(PartialQueries(items=items))
    target = opened.queries
    await lead.peer.write_many(target.region, extents, tag=target.slot, meta=meta, timeout_s=ctx.timeout_s)
    notice = await ctx.receiver.wait(
        REPLY_REGION, lead.slot, timeout_s=ctx.timeout_s, peer_id=opened.sender_id
    )
    replies = decode(notice.meta, PartialReplies)
    if replies.error:
        raise TransportError(f"holder refused the queries: {replies.error}")
    sent = [(i.request_id, i.step, i.layer, i.num_tokens) for i in items]
    if [(r.request_id, r.step, r.layer, r.num_tokens) for r in replies.items] != sent:
        raise TransportError(f"replies for {len(replies.items)} queries do not match the {len(items)} sent")
    answered = sum(r.num_tokens for r in replies.items if not r.error) * ctx.partial_bytes_per_token
    if notice.nbytes != answered:
        raise TransportError(f"{notice.nbytes} reply bytes for {answered} bytes of partials")
    elapsed = time.perf_counter() - started
    metrics.EXCHANGE.observe(elapsed)
    metrics.EXCHANGE_SIZE.observe(len(queries))
    for query, reply in zip(queries, replies.items, strict=True):
        session = query.session
        session.step_s += elapsed
        if reply.error:
            query.future.set_exception(TransportError(f"holder refused the query: {reply.error}"))
            continue
        nbytes = reply.num_tokens * ctx.partial_bytes_per_token
        query.future.set_result(ctx.area.region.view(session.offset, nbytes).view(np.float32))

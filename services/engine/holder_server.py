"""The holder side of move-the-query: route sessions over held chunks, one attention call per batch.

`RouteOpen` (NATS, `route.<engine>`) opens a session: the chunk is looked up by hash (unknown: the open fails
with an error the requester falls back on), an extent of the holder's query region is reserved, and a task
serves the session: it waits for query notices on the session's tag. A notice carries the queries of every
request of one requester forward that routes here (`PartialQueries`, see shared/protocol/movequery.py), so
the session whose tag it came on leads a group: each item is checked (an open session of the same requester,
layer and step in order, size; NaN or inf rows are refused by the runtime), the group goes to the batcher
at once, and every packed (o, m, l) goes back into its request's reply extent in one write with one notice
on the lead's reply tag (a refused item gets its error and no bytes). Every wait is bounded by the request's
deadline and fails at once when the requester's data-plane connection goes; `RouteClose` or either of those
ends the session and frees what it held.

The batcher runs whatever queries are queued when the model thread is free as one `held_partials` call
(one attention per chunk range and layer for all requesters), so a busy holder batches more; it measures
how long queries wait and the call takes, which the load reports and every reply carry (the cost model's
holder queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from gpu.partial_attention_remote import HeldJob
from services.engine import metrics
from services.engine.holder import HeldChunk, HeldChunks
from services.engine.peers import PeerPool
from services.engine.route_region import RouteRegion, peer_ref
from services.engine.route_shape import partial_bytes_per_token, query_bytes_per_token
from shared.errors import InvalidRequestError, KvpathError, OverloadedError, ProtocolError
from shared.protocol import Ack, decode, encode
from shared.protocol.movequery import (
    ChunkList,
    ChunkQuery,
    ChunkUnpin,
    PartialQueries,
    PartialQuery,
    PartialReplies,
    PartialReply,
    RouteClose,
    RouteOpen,
    RouteOpened,
)
from shared.transport import KvReceiver, Notice

log = logging.getLogger(__name__)

QUERY_REGION = "mq_queries"
EWMA = 0.2


@dataclass(slots=True, eq=False)
class _Session:
    request: RouteOpen
    chunk: HeldChunk
    offset: int
    size_bytes: int
    slot: int
    task: asyncio.Task[None] | None = None
    step: int = 0  # the step and layer its next query must carry
    layer: int = 0


class HolderBatcher:
    """Queued partial-attention jobs, run together whenever the model thread is free."""

    def __init__(self, runner: Any, *, max_pending: int) -> None:
        self.runner = runner
        self.max_pending = max_pending
        self._queue: list[tuple[Any, asyncio.Future[Any], float]] = []
        self._wake = asyncio.Event()
        self.queue_s = 0.0  # EWMA of the wait before the call
        self.compute_s = 0.0  # EWMA of one call
        self.num_calls = 0
        self.num_jobs = 0

    async def submit(self, jobs: list[Any]) -> list[tuple[Any, float, float]]:
        """Per job (all queued at once, so one call takes them together): (packed partial or the refusal,
        seconds queued, seconds of the call)."""
        if len(self._queue) + len(jobs) > self.max_pending:
            raise OverloadedError(f"holder has {len(self._queue)} partial-attention queries queued")
        loop, now = asyncio.get_running_loop(), time.perf_counter()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in jobs]
        self._queue.extend((job, future, now) for job, future in zip(jobs, futures, strict=True))
        self._wake.set()
        return list(await asyncio.gather(*futures))

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue, []
            if not batch:
                continue
            started = time.perf_counter()
            try:
                results = await self.runner.held_partials([job for job, _, _ in batch])
            except Exception as exc:  # a runtime failure refuses this batch, never the loop
                log.exception("partial attention failed")
                results = [f"holder attention failed: {type(exc).__name__}"] * len(batch)
            compute_s = time.perf_counter() - started
            self.compute_s += EWMA * (compute_s - self.compute_s)
            self.num_calls += 1
            self.num_jobs += len(batch)
            metrics.HOLDER_BATCH.observe(len(batch))
            for (_, future, queued_at), result in zip(batch, results, strict=True):
                queued = started - queued_at
                self.queue_s += EWMA * (queued - self.queue_s)
                if not future.done():
                    future.set_result((result, queued, compute_s))


class HolderServer:
    def __init__(
        self,
        runner: Any,
        held: HeldChunks,
        *,
        receiver: KvReceiver,
        sender_id: str,
        peers: PeerPool,
        engine_id: str,
        fingerprint: str,
        region_bytes: int,
        timeout_s: float,
        max_pending: int = 4096,
    ) -> None:
        self.runner = runner
        self.held = held
        self.receiver = receiver
        self.sender_id = sender_id
        self.peers = peers
        self.engine_id = engine_id
        self.fingerprint = fingerprint
        self.timeout_s = timeout_s
        self.num_layers = runner.spec.num_layers
        self.query_bytes_per_token = query_bytes_per_token(runner)
        self.partial_bytes_per_token = partial_bytes_per_token(runner)
        self.batcher = HolderBatcher(runner, max_pending=max_pending)
        self.queries = RouteRegion(
            receiver, QUERY_REGION, region_bytes, engine_id=engine_id, label="holder query region"
        )
        self._sessions: dict[str, _Session] = {}  # by request id: what RouteClose names
        self._batcher_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._batcher_task = asyncio.create_task(self.batcher.run(), name="holder-batcher")

    async def close(self) -> None:
        for session in list(self._sessions.values()):
            await self._end(session)
        if self._batcher_task is not None:
            self._batcher_task.cancel()
            await asyncio.gather(self._batcher_task, return_exceptions=True)
        with contextlib.suppress(KvpathError):
            self.receiver.unregister_region(QUERY_REGION)

    # ------------------------------------------------------------------------------------------ control

    message_types = (RouteOpen, RouteClose, ChunkQuery, ChunkUnpin)  # what `route.<engine>` carries

    async def handle(
        self, msg: RouteOpen | RouteClose | ChunkQuery | ChunkUnpin, ctx: Any
    ) -> RouteOpened | Ack | ChunkList:
        """The bus handler of `route.<engine>` (errors go back as error replies)."""
        if isinstance(msg, RouteOpen):
            return await self.open(msg)
        if isinstance(msg, ChunkQuery):
            return self._chunk_list([c for c in self.held.chunks if c.names and c.tenant == msg.tenant])
        if isinstance(msg, ChunkUnpin):
            return self._chunk_list(self.held.unpin(msg.chunk))
        return await self.close_session(msg)

    def _chunk_list(self, chunks: list[HeldChunk]) -> ChunkList:
        infos = self.held.infos(chunks)
        for info in infos:
            info.engine_id = self.engine_id
        return ChunkList(chunks=infos)

    async def open(self, msg: RouteOpen) -> RouteOpened:
        chunk = self.held.find(msg.chunk_hash, msg.num_blocks)
        if chunk is None:
            metrics.HOLDER_SESSIONS.labels("unknown_chunk").inc()
            raise InvalidRequestError(
                f"engine {self.engine_id} holds no chunk of {msg.num_blocks} blocks ending in "
                f"{msg.chunk_hash:016x}",
                param="chunk_hash",
            )
        self._check_shape(msg)
        if msg.request_id in self._sessions:
            raise InvalidRequestError(f"route session {msg.request_id} is open already", param="request_id")
        size = msg.max_query_tokens * self.query_bytes_per_token
        try:
            offset, slot = self.queries.reserve(size)
        except OverloadedError:
            metrics.HOLDER_SESSIONS.labels("full").inc()
            raise
        session = _Session(msg, chunk, offset, size, slot)
        self.held.acquire(chunk)
        self._sessions[msg.request_id] = session
        session.task = asyncio.create_task(self._serve(session), name=f"route:{msg.request_id}")
        metrics.HOLDER_SESSIONS.labels("opened").inc()
        return RouteOpened(
            queries=self.queries.buffer(offset, size, slot),
            sender_id=self.sender_id,
            num_layers=self.num_layers,
            partial_bytes_per_token=self.partial_bytes_per_token,
            queue_s=self.batcher.queue_s,
        )

    def _check_shape(self, msg: RouteOpen) -> None:
        if msg.fingerprint != self.fingerprint:
            raise InvalidRequestError(
                f"KV format {msg.fingerprint!r} is not this holder's", param="fingerprint"
            )
        if msg.query_bytes_per_token != self.query_bytes_per_token:
            raise InvalidRequestError(
                f"{msg.query_bytes_per_token} query bytes per token, this model takes "
                f"{self.query_bytes_per_token}",
                param="query_bytes_per_token",
            )
        if (
            msg.max_query_tokens <= 0
            or msg.reply.size_bytes < msg.max_query_tokens * self.partial_bytes_per_token
        ):
            raise InvalidRequestError(
                f"reply extent of {msg.reply.size_bytes} bytes cannot take {msg.max_query_tokens} tokens' "
                "partials",
                param="reply",
            )

    async def close_session(self, msg: RouteClose) -> Ack:
        session = self._sessions.get(msg.request_id)
        if session is not None:
            await self._end(session)
        return Ack(ok=session is not None)

    async def _end(self, session: _Session) -> None:
        if self._sessions.pop(session.request.request_id, None) is None:
            return
        task, session.task = session.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.queries.release(session.offset, session.slot)
        self.held.release(session.chunk)

    # --------------------------------------------------------------------------------------- data plane

    async def _serve(self, session: _Session) -> None:
        request = session.request
        try:
            peer = await self.peers.get(peer_ref(request.reply), timeout_s=self.timeout_s)
            while True:
                remaining = request.deadline_unix_s - time.time()
                notice = await self.receiver.wait(
                    QUERY_REGION, session.slot, timeout_s=max(0.01, remaining), peer_id=request.sender_id
                )
                replies, extents = await self._answer(session, notice)
                await peer.write_many(
                    request.reply.region,
                    extents,
                    tag=request.reply.slot,
                    meta=encode(replies),
                    timeout_s=self.timeout_s,
                )
        except KvpathError as exc:
            log.debug("route session ended request_id=%s: %s", request.request_id, exc.message)
        finally:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._end(session)))

    async def _answer(self, lead: _Session, notice: Notice) -> tuple[PartialReplies, list[tuple[int, Any]]]:
        """The reply to one group's query notice: (meta, reply extents of the items answered)."""
        try:
            queries = decode(notice.meta, PartialQueries)
        except ProtocolError as exc:
            metrics.HOLDER_REFUSED.inc()
            return PartialReplies(error=exc.message), []
        nbytes = sum(item.num_tokens for item in queries.items) * self.query_bytes_per_token
        error = ""
        if not queries.items or queries.items[0].request_id != lead.request.request_id:
            error = f"the first query must be route session {lead.request.request_id}'s, whose tag it came on"
        elif nbytes != notice.nbytes:
            error = f"{notice.nbytes} bytes written for {nbytes} bytes of queries"
        if error:
            metrics.HOLDER_REFUSED.inc()
            return PartialReplies(error=error), []
        replies = [
            PartialReply(request_id=q.request_id, step=q.step, layer=q.layer, num_tokens=q.num_tokens)
            for q in queries.items
        ]
        members: list[tuple[PartialReply, _Session, HeldJob]] = []
        seen: set[str] = set()
        for item, reply in zip(queries.items, replies, strict=True):
            session = self._sessions.get(item.request_id)
            reply.error = self._refusal(lead, session, item, seen)
            if reply.error or session is None:
                metrics.HOLDER_REFUSED.inc()
                continue
            seen.add(item.request_id)
            members.append((reply, session, self._job(session, item)))
        try:
            results = await self.batcher.submit([job for _, _, job in members]) if members else []
        except OverloadedError as exc:
            results = [(exc.message, 0.0, 0.0)] * len(members)
        extents: list[tuple[int, Any]] = []
        for (reply, session, _), (result, queued_s, compute_s) in zip(members, results, strict=True):
            reply.queue_s, reply.compute_s = queued_s, compute_s
            if isinstance(result, str):
                metrics.HOLDER_REFUSED.inc()
                reply.error = result
                continue
            metrics.HOLDER_ROWS.inc(reply.num_tokens)
            extents.append((session.request.reply.offset, result))
            session.layer += 1
            if session.layer == self.num_layers:
                session.step, session.layer = session.step + 1, 0
        return PartialReplies(items=replies), extents

    def _refusal(self, lead: _Session, session: _Session | None, item: PartialQuery, seen: set[str]) -> str:
        """Why one item of a group is refused ("": it is answered)."""
        if session is None or item.request_id in seen:
            return f"no open route session {item.request_id} (or named twice)"
        mine, theirs = session.request, lead.request
        if (mine.sender_id, mine.reply.engine_id, mine.reply.region) != (
            theirs.sender_id,
            theirs.reply.engine_id,
            theirs.reply.region,
        ):
            return f"route session {item.request_id} is not one of this requester's"
        if (item.step, item.layer) != (session.step, session.layer):
            return (
                f"expected step {session.step} layer {session.layer}, got step {item.step} layer {item.layer}"
            )
        if item.num_tokens * self.query_bytes_per_token > session.size_bytes:
            return f"{item.num_tokens} query tokens do not fit the session's extent"
        return ""

    def _job(self, session: _Session, item: PartialQuery) -> HeldJob:
        chunk, num_blocks = session.chunk, session.request.num_blocks
        return HeldJob(
            block_ids=chunk.block_ids[:num_blocks],
            num_tokens=num_blocks * chunk.block_size,
            layer=item.layer,
            query=self.queries.region.view(session.offset, item.num_tokens * self.query_bytes_per_token),
            num_query_tokens=item.num_tokens,
        )

    # ------------------------------------------------------------------------------------------ reports

    def report(self) -> dict[str, Any]:
        """The holder's part of the load report's `RouteCapability`."""
        return {
            "holder_queue_s": self.batcher.queue_s,
            "holder_compute_s": self.batcher.compute_s,
            "num_holder_sessions": len(self._sessions),
            "num_held_blocks": self.held.num_blocks,
            "hold_budget_blocks": self.held.budget_blocks,
        }

"""The holder side of move-the-query: route sessions over held chunks, one attention call per batch.

`RouteOpen` (NATS, `route.<engine>`) opens a session: the chunk is looked up by hash (unknown: the open fails
with an error the requester falls back on), an extent of the holder's query region is reserved, and a task
serves the session: it waits for the requester's query notice (one tag per session; the layer and step are
in the notice's meta and must come in order), checks it (meta, size, layer, step; NaN or inf rows are refused
by the runtime), hands it to the batcher, and writes the packed (o, m, l) into the requester's reply extent
with one write and one notice, or an error notice with no bytes. Every wait is bounded by the request's
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
    PartialQuery,
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

    async def submit(self, job: Any) -> tuple[Any, float, float]:
        """(packed partial or the refusal, seconds queued, seconds of the call)."""
        if len(self._queue) >= self.max_pending:
            raise OverloadedError(f"holder has {len(self._queue)} partial-attention queries queued")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((job, future, time.perf_counter()))
        self._wake.set()
        return await future  # type: ignore[no-any-return]

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
        step = layer = 0
        try:
            peer = await self.peers.get(peer_ref(request.reply), timeout_s=self.timeout_s)
            while True:
                remaining = request.deadline_unix_s - time.time()
                notice = await self.receiver.wait(
                    QUERY_REGION, session.slot, timeout_s=max(0.01, remaining), peer_id=request.sender_id
                )
                reply, data = await self._answer(session, notice, step, layer)
                extents = [(request.reply.offset, data)] if data is not None else []
                await peer.write_many(
                    request.reply.region,
                    extents,
                    tag=request.reply.slot,
                    meta=encode(reply),
                    timeout_s=self.timeout_s,
                )
                if not reply.error:
                    step, layer = (step + 1, 0) if layer + 1 == self.num_layers else (step, layer + 1)
        except KvpathError as exc:
            log.debug("route session ended request_id=%s: %s", request.request_id, exc.message)
        finally:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._end(session)))

    async def _answer(
        self, session: _Session, notice: Notice, step: int, layer: int
    ) -> tuple[PartialReply, Any]:
        """The reply to one query notice: (meta, packed partial bytes or None with meta.error set)."""
        try:
            query = decode(notice.meta, PartialQuery)
        except ProtocolError as exc:
            return PartialReply(step=step, layer=layer, num_tokens=0, error=exc.message), None
        error = ""
        nbytes = query.num_tokens * self.query_bytes_per_token
        if (query.step, query.layer) != (step, layer):
            error = f"expected step {step} layer {layer}, got step {query.step} layer {query.layer}"
        elif query.num_tokens <= 0 or nbytes != notice.nbytes or nbytes > session.size_bytes:
            error = (
                f"{notice.nbytes} bytes written for {query.num_tokens} query tokens of "
                f"{self.query_bytes_per_token} bytes"
            )
        if error:
            metrics.HOLDER_REFUSED.inc()
            return PartialReply(step=step, layer=layer, num_tokens=query.num_tokens, error=error), None
        chunk, num_blocks = session.chunk, session.request.num_blocks
        job = HeldJob(
            block_ids=chunk.block_ids[:num_blocks],
            num_tokens=num_blocks * chunk.block_size,
            layer=layer,
            query=self.queries.region.view(session.offset, nbytes),
            num_query_tokens=query.num_tokens,
        )
        try:
            result, queued_s, compute_s = await self.batcher.submit(job)
        except OverloadedError as exc:
            result, queued_s, compute_s = exc.message, 0.0, 0.0
        reply = PartialReply(
            step=step, layer=layer, num_tokens=query.num_tokens, queue_s=queued_s, compute_s=compute_s
        )
        if isinstance(result, str):
            metrics.HOLDER_REFUSED.inc()
            reply.error = result
            return reply, None
        metrics.HOLDER_ROWS.inc(query.num_tokens)
        return reply, result

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

"""The requester side of one routed request: a session with the holder, per-layer exchanges, the fallback.

`RouteSession` is the engine's `ChunkExchange` (gpu/partial_attention_remote.py): the runtime calls `send`,
`flush` and `receive` from its worker thread, once per layer of every forward of the sequence; `send` queues
the query rows and `flush` sends the queries of every routed sequence of the forward that share a holder as
one exchange on the event loop (route_exchange.py); the packed partial is read in place from this engine's
reply region (no copy). `receive` returns None, which makes the runtime fall back inside the same step, when
the exchange fails, misses `timeout_s`, the holder refuses it, or the cost model says to stop routing (between
decode steps: the remaining steps at the measured price cost more than taking the chunk here). `fallback`
then fetches the chunk from the store (a read lease kept until the session is released) or hands back its
token ids to recompute; either way the request's tokens are the ones it would have produced anyway.

Ownership: the session owns its reply extent (quarantined for `QUARANTINE_S` after a failure, since a late
reply may still land in it), its read lease and its holder session; `close` gives all of them back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu.side_work import SideWork
from services.engine import metrics
from services.engine.node_storage import NodeStorage
from services.engine.peers import PeerPool
from services.engine.route_exchange import REPLY_REGION, Query, RouteExchanges
from services.engine.route_region import RouteRegion, peer_ref
from services.engine.sequence import Sequence
from services.policy.movequery import take_chunk_now
from shared.bus import Bus
from shared.errors import KvpathError, TransportError
from shared.kvclient import ReadLease
from shared.protocol import Ack
from shared.protocol.movequery import HeldPrefix, PartialQuery, RouteClose, RouteOpen, RouteOpened
from shared.transport import KvReceiver

log = logging.getLogger(__name__)

QUARANTINE_S = 30.0  # a failed session's reply extent waits this long before reuse (a late reply may land)
CLOSE_TIMEOUT_S = 1.0


class ReplyArea:
    """The region holders write partials into: one extent and one notice slot per session."""

    def __init__(self, receiver: KvReceiver, size_bytes: int, *, engine_id: str) -> None:
        self.replies = RouteRegion(
            receiver, REPLY_REGION, size_bytes, engine_id=engine_id, label="route reply region"
        )
        self.region = self.replies.region
        self._quarantined: list[tuple[float, int, int]] = []  # (until, offset, slot)

    def reserve(self, nbytes: int) -> tuple[int, int]:
        now = time.monotonic()
        for item in [q for q in self._quarantined if q[0] <= now]:
            self._quarantined.remove(item)
            self.replies.release(item[1], item[2])
        return self.replies.reserve(nbytes)

    def free(self, offset: int, slot: int, *, quarantine: bool) -> None:
        if quarantine:
            self._quarantined.append((time.monotonic() + QUARANTINE_S, offset, slot))
        else:
            self.replies.release(offset, slot)


@dataclass(slots=True)
class RouteContext:
    """What every session of one engine shares."""

    bus: Bus
    receiver: KvReceiver
    peers: PeerPool
    area: ReplyArea
    storage: NodeStorage
    engine_id: str
    sender_id: str
    fingerprint: str
    block_size: int
    num_layers: int
    query_bytes_per_token: int
    partial_bytes_per_token: int
    timeout_s: float  # one exchange (and the session open)
    side: SideWork = field(default_factory=SideWork)  # the runner's: a blocked forward serves holder calls
    exchanges: RouteExchanges = field(default_factory=RouteExchanges)  # queued until the runtime flushes


class RouteSession:
    def __init__(self, ctx: RouteContext, seq: Sequence, held: HeldPrefix, max_query_tokens: int) -> None:
        self.ctx = ctx
        self.seq = seq
        self.held = held
        self.num_tokens = held.num_blocks * ctx.block_size
        self.fallback_state: Any = None  # the runtime's local copy once the route is given up
        self.max_query_tokens = max_query_tokens
        self.loop = asyncio.get_running_loop()
        self.offset, self.slot = ctx.area.reserve(max_query_tokens * ctx.partial_bytes_per_token)
        self.opened: RouteOpened | None = None
        self.peer: Any = None
        self.step = 0
        self.failure = ""  # why the route was given up ("" while routing)
        self.last_step_s = 0.0  # the last full step's exchanges, for the between-steps re-evaluation
        self.step_s = 0.0  # this step's so far (route_exchange.py adds each round trip)
        self._inflight: concurrent.futures.Future[np.ndarray] | None = None
        self._lease: ReadLease | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------ control plane

    async def open(self) -> None:
        """Open the session with the holder (bounded by timeout_s); a KvpathError says why it could not."""
        ctx, held = self.ctx, self.held
        reply = ctx.area.replies.buffer(
            self.offset, self.max_query_tokens * ctx.partial_bytes_per_token, self.slot
        )
        request = RouteOpen(
            request_id=self.seq.request_id,
            chunk_hash=self.seq.block_hashes[held.num_blocks - 1],
            num_blocks=held.num_blocks,
            fingerprint=ctx.fingerprint,
            query_bytes_per_token=ctx.query_bytes_per_token,
            max_query_tokens=self.max_query_tokens,
            reply=reply,
            sender_id=ctx.sender_id,
            deadline_unix_s=self.seq.deadline_unix_s,
        )
        subject = ctx.bus.subjects.route(held.holder_id)
        self.opened = await ctx.bus.request(subject, request, RouteOpened, timeout_s=ctx.timeout_s)
        self.peer = await ctx.peers.get(peer_ref(self.opened.queries), timeout_s=ctx.timeout_s)

    async def close(self) -> None:
        """End the session: tell the holder (bounded), give back the extent and the lease. Idempotent."""
        if self._closed:
            return
        self._closed = True
        inflight, self._inflight = self._inflight, None
        clean = self.opened is not None and inflight is None
        if self.opened is not None:
            try:
                msg = RouteClose(request_id=self.seq.request_id)
                subject = self.ctx.bus.subjects.route(self.held.holder_id)
                await self.ctx.bus.request(subject, msg, Ack, timeout_s=CLOSE_TIMEOUT_S)
            except KvpathError:
                clean = False  # the holder may still write: keep the extent out of use for a while
        self.ctx.area.free(self.offset, self.slot, quarantine=not clean or bool(self.failure))
        lease, self._lease = self._lease, None
        self.ctx.storage.release(lease)

    # ------------------------------------------------------------------- data plane (the worker thread)

    def send(self, layer: int, query: memoryview) -> None:
        if layer == 0:
            self._new_step()
        if self.failure:
            return
        future: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        self._inflight = future
        ctx, num_tokens = self.ctx, len(query) // self.ctx.query_bytes_per_token
        if (
            num_tokens * ctx.query_bytes_per_token != len(query)
            or not 0 < num_tokens <= self.max_query_tokens
        ):
            future.set_exception(
                TransportError(
                    f"{len(query)} query bytes do not fit the session's {self.max_query_tokens} tokens"
                )
            )
            return
        item = PartialQuery(
            request_id=self.seq.request_id, step=self.step, layer=layer, num_tokens=num_tokens
        )
        ctx.exchanges.add(Query(self, item, query, future))

    def flush(self) -> None:
        """Send what the forward's sequences queued for this layer (every session of the engine at once)."""
        self.ctx.exchanges.flush()

    def receive(self, layer: int) -> np.ndarray | None:
        inflight, self._inflight = self._inflight, None
        if self.failure or inflight is None:
            return None
        self.ctx.exchanges.flush()  # a no-op when the runtime flushed after its sends
        started = time.perf_counter()
        try:
            packed = self.ctx.side.wait(inflight, 3 * self.ctx.timeout_s)  # the exchange bounds itself
        except Exception as exc:  # failed, refused, cut off or late: the runtime falls back
            reason = exc.code if isinstance(exc, KvpathError) else "deadline"
            self._give_up(reason, getattr(exc, "message", "") or repr(exc))
            return None
        finally:
            self.ctx.exchanges.stalled(time.perf_counter() - started)
        if layer + 1 == self.ctx.num_layers:
            self.step += 1
        return packed

    def _new_step(self) -> None:
        """Between steps: the route's measured price against taking the chunk here (the cost model)."""
        self.last_step_s, self.step_s = self.step_s, 0.0
        remaining = self.seq.sampling.max_tokens - len(self.seq.output_token_ids)
        held = self.held
        if self.failure or not self.seq.output_token_ids or held.take_s <= 0 or self.last_step_s <= 0:
            return
        if take_chunk_now(
            remaining_steps=remaining,
            route_step_s=self.last_step_s,
            local_step_s=held.local_step_s,
            take_s=held.take_s,
        ):
            self._give_up(
                "repriced", f"{remaining} steps at {self.last_step_s * 1e3:.2f} ms cost more than a take"
            )

    def _give_up(self, reason: str, detail: str) -> None:
        if self.failure:
            return
        self.failure = reason
        metrics.FALLBACKS.labels(reason).inc()
        rid = self.seq.request_id
        log.warning(
            "route given up request_id=%s reason=%s: %s", rid, reason, detail, extra={"request_id": rid}
        )

    def fallback(self) -> np.ndarray | Seq[int]:
        """The chunk here: its Full Blocks from the store when the plan says fetch and they read, else its
        tokens to recompute. Worker thread; the fetch waits at most the request's deadline."""
        self._give_up("failed", "the runtime asked for the chunk")
        held, n = self.held, self.held.num_blocks
        if held.fallback == "fetch" and held.num_store_blocks >= n:
            read = self.ctx.storage.read_prefix(self.seq, n)
            remaining = max(0.01, self.seq.deadline_unix_s - time.time())
            try:
                lease = asyncio.run_coroutine_threadsafe(read, self.loop).result(timeout=remaining)
            except (KvpathError, concurrent.futures.TimeoutError, TimeoutError):
                lease = None
            if lease is not None and lease.num_blocks >= n:
                self._lease = lease
                metrics.ROUTED.labels("fallback_fetch").inc()
                return lease.views[:n]
            self.ctx.storage.release(lease)
        metrics.ROUTED.labels("fallback_local").inc()
        return self.seq.prompt_token_ids[: self.num_tokens]

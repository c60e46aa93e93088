"""Move the query, not the cache: the connector of an engine that routes held prefixes and may hold chunks.

`RouteConnector` wraps the engine's colocated connector (every hook is delegated to it) and adds:
- requester: a request whose plan carries a `HeldPrefix` with primitive `route` opens a session with the
  holder before it is scheduled (`load`). Its block table then starts with placeholders for the chunk
  (`kv.null_block`: no cache memory), it is scheduled as if the chunk were loaded, and every forward gets the
  session as its attention prefix (`attention_prefix`): the runtime ships each layer's query rows to the
  holder and merges the partial it sends back. A session that cannot open falls back at once to the plan's
  fallback (fetch: the store's blocks, as any hit; local: recompute); one that fails later falls back inside
  the step (route_session.py). Preemption ends the route: the request is recomputed here.
- holder (`hold_bytes` > 0): when a request finishes, the leading full blocks of its prompt are pinned as a
  chunk (if long enough and not sharing a held chunk) instead of being freed; a request naming a chunk
  (`plan.pin`, the `kv_chunk` extension) keeps them under that name, whatever their length, or names the held
  chunk that covers them; `holder_server.py` serves the route sessions; a request that lands on the holder
  itself copies the chunk's blocks into its own before layer 0.
Plans with primitive `fetch` or `local` need nothing here: the router set their stored hits accordingly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from gpu.runner import LayerHook, PrefillSeq
from services.engine import metrics
from services.engine.colocated_connector import ColocatedConnector
from services.engine.connector import KvConnector
from services.engine.holder import ChunkEvents, HeldChunk, HeldChunks
from services.engine.holder_server import HolderServer
from services.engine.persist import PersistChain
from services.engine.route_session import ReplyArea, RouteContext, RouteSession
from services.engine.route_shape import partial_bytes_per_token, query_bytes_per_token, route_capability
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared.blocks import max_hit_blocks
from shared.errors import KvpathError
from shared.hashing import fingerprint_seed
from shared.protocol import RouteCapability
from shared.protocol.movequery import ChunkName, HeldPrefix
from shared.protocol.tasks import BufferRef, PullHits, PullHitsReply, Task

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RouteState:
    """A request's move-the-query part (`seq.route`)."""

    session: RouteSession | None = None  # routed: attention over the chunk comes from its holder
    held: HeldChunk | None = None  # served by the holder itself: the chunk is copied in before layer 0
    num_held_blocks: int = 0


class HeldImportHook(LayerHook):
    """On the holder: copies a held chunk's blocks into the request's own before layer 0 (all layers)."""

    def __init__(self, kv: Any, imports: list[tuple[Sequence, HeldChunk, int]]) -> None:
        self.kv = kv
        self.imports = imports

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        if layer == 0:
            for seq, chunk, n in self.imports:
                self.kv.copy_blocks(chunk.block_ids[:n], seq.block_ids[:n])


class _Hooks(LayerHook):
    def __init__(self, hooks: list[LayerHook]) -> None:
        self.hooks = hooks

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        for hook in self.hooks:
            await hook.before_layer(layer, seqs)

    async def after_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        for hook in self.hooks:
            await hook.after_layer(layer, seqs)


class RouteConnector(KvConnector):
    def __init__(
        self,
        inner: ColocatedConnector,
        ctx: RouteContext,
        runner: Any,
        *,
        max_query_tokens: int,
        holder: HolderServer | None = None,
        hold_min_tokens: int = 0,
    ) -> None:
        self.inner = inner
        self.ctx = ctx
        self.runner = runner
        self.kv = runner.kv
        self.block_size = ctx.block_size
        self.max_query_tokens = max_query_tokens
        self.holder = holder
        self.held: HeldChunks | None = holder.held if holder is not None else None
        self.hold_min_tokens = hold_min_tokens
        self.task_type = inner.task_type
        self.serves_pulls = inner.serves_pulls
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.inner.start()
        if self.holder is not None:
            await self.holder.start()
            if self.holder.held.events is not None:
                await self.holder.held.events.start()

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.holder is not None:
            await self.holder.close()
            if self.holder.held.events is not None:
                await self.holder.held.events.close()
        await self.inner.close()

    def block_allocator(self, kv: Any) -> Any:
        return self.inner.block_allocator(kv)

    def accept(self, seq: Sequence, task: Task) -> BufferRef | None:
        self.inner.accept(seq, task)  # a colocated engine hands out no buffer
        return None

    # ------------------------------------------------------------------------------------------- load

    async def load(self, seq: Sequence) -> None:
        kv_plan, bs = seq.plan.kv, self.block_size
        usable = min(len(seq.block_hashes), max_hit_blocks(seq.num_prompt_tokens, bs))
        if self.held is not None:
            chunk, n = self.held.longest(seq.block_hashes[:usable])
            if chunk is not None and n >= kv_plan.num_hit_blocks:
                await self._load_held_here(seq, chunk, n)
                return
        held = kv_plan.held
        if held is not None and held.primitive == "route" and 0 < held.num_blocks <= usable:
            if held.holder_id != self.ctx.engine_id and await self._open_route(seq, held):
                return
            kv_plan.num_hit_blocks = min(usable, held.num_store_blocks) if held.fallback == "fetch" else 0
            metrics.ROUTED.labels(f"open_failed_{held.fallback}").inc()
        elif held is not None:
            metrics.ROUTED.labels(held.primitive).inc()
        await self.inner.load(seq)

    async def _open_route(self, seq: Sequence, held: HeldPrefix) -> bool:
        n = held.num_blocks
        max_query = max(1, min(self.max_query_tokens, seq.num_prompt_tokens - n * self.block_size))
        session = None
        try:
            session = RouteSession(self.ctx, seq, held, max_query)
            await session.open()
        except KvpathError as exc:
            rid = seq.request_id
            log.warning("route open failed request_id=%s holder=%s: %s", rid, held.holder_id, exc.message)
            if session is not None:
                await session.close()
            return False
        seq.plan.kv.num_hit_blocks = 0
        await self.inner.load(seq)
        seq.block_ids = [self.kv.null_block] * n  # the chunk's positions take no cache memory here
        seq.num_hit_tokens = n * self.block_size
        seq.kv_state.chain = PersistChain(n)  # the chunk's blocks are the holder's (and the store's)
        seq.kv_state.num_pool_blocks = n  # nor are they written into a pool: this cache never had them
        seq.route = RouteState(session=session)
        metrics.ROUTED.labels("route").inc()
        return True

    async def _load_held_here(self, seq: Sequence, chunk: HeldChunk, n: int) -> None:
        assert self.held is not None
        self.held.acquire(chunk)
        seq.route = RouteState(held=chunk, num_held_blocks=n)
        seq.plan.kv.num_hit_blocks = 0
        await self.inner.load(seq)
        seq.num_hit_tokens = n * self.block_size
        seq.kv_state.chain = PersistChain(n)
        metrics.ROUTED.labels("held_here").inc()

    def attention_prefix(self, seq: Sequence) -> Any:
        state = seq.route
        return state.session if state is not None else None

    # ------------------------------------------------------------------------------------- the steps

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        hook = self.inner.layer_hook(chunks)
        imports = [
            (c.seq, c.seq.route.held, c.seq.route.num_held_blocks)
            for c in chunks
            if c.load_tokens and c.seq.route is not None and c.seq.route.held is not None
        ]
        if not imports:
            return hook
        held_hook = HeldImportHook(self.kv, imports)
        return held_hook if hook is None else _Hooks([held_hook, hook])

    def import_prefilled(self, chunks: Seq[PrefillChunk]) -> None:
        self.inner.import_prefilled(chunks)

    def save(self, seqs: Seq[Sequence]) -> None:
        self.inner.save(seqs)

    def failure(self, seq: Sequence) -> KvpathError | None:
        return self.inner.failure(seq)

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        wait = self.inner.finish(seq)
        if self.held is not None and seq.finish_reason in ("stop", "length"):
            if seq.plan.pin is not None:
                self._pin_named(seq, seq.plan.pin)
            elif seq.route is None:
                self._pin(seq)
        return wait

    def _pin_named(self, seq: Sequence, name: ChunkName) -> None:
        """Keep the prompt's leading full blocks under the client's name: a held chunk covering all of them
        takes the name, else they become a new chunk (one copied in from a shorter chunk here supersedes it
        when that one is idle and unnamed)."""
        assert self.held is not None
        n = min(seq.num_prompt_tokens, seq.num_computed_tokens) // self.block_size
        chunk, covered = self.held.longest(seq.block_hashes[:n])
        if chunk is not None and covered == n > 0:
            named = self.held.name(chunk, name)
            metrics.HELD_PINS.labels("named" if named else "failed").inc()
            if not named:
                log.warning("chunk %r not named request_id=%s: the tenant's share", name.name, seq.request_id)
            return
        state = seq.route
        if state is not None and state.held is not None:  # its blocks are copies: the shorter chunk may go
            self.held.release(state.held)
            state.held = None
        routed = state is not None and state.session is not None  # its blocks lack the chunk
        if n > 0 and not routed and len(seq.block_ids) >= n:
            if self.held.pin(seq.block_ids[:n], seq.block_hashes[:n], name) is not None:
                seq.block_ids = seq.block_ids[n:]  # the scheduler frees the rest
                metrics.HELD_PINS.labels("new").inc()
                return
        metrics.HELD_PINS.labels("failed").inc()
        log.warning("chunk %r not pinned request_id=%s: %d full blocks", name.name, seq.request_id, n)

    def _pin(self, seq: Sequence) -> None:
        """Keep the prompt's leading full blocks as a held chunk (they are not freed with the request)."""
        assert self.held is not None
        n = min(seq.num_prompt_tokens, seq.num_computed_tokens) // self.block_size
        if n * self.block_size < max(self.hold_min_tokens, 1) or len(seq.block_ids) < n:
            return
        if self.held.longest(seq.block_hashes[:n])[1]:
            return  # it shares a held chunk: a user of one, not a new one
        if self.held.pin(seq.block_ids[:n], seq.block_hashes[:n]) is not None:
            seq.block_ids = seq.block_ids[n:]  # the scheduler frees the rest

    def release(self, seq: Sequence) -> None:
        state, seq.route = seq.route, None
        if state is not None:
            if state.session is not None:
                task = asyncio.create_task(state.session.close())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if state.held is not None and self.held is not None:
                self.held.release(state.held)
        self.inner.release(seq)

    async def serve_pull(self, seq: Sequence, msg: PullHits) -> PullHitsReply:
        return await self.inner.serve_pull(seq, msg)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def pinned_blocks(self) -> int:
        return self.held.num_blocks if self.held is not None else 0

    def route_capability(self) -> RouteCapability:
        holder = self.holder.report() if self.holder is not None else {}
        return route_capability(self.runner, route_step_s=self.ctx.exchanges.steps.value, **holder)


def build_route_connector(config: Any, service: Any, inner: KvConnector) -> RouteConnector:
    """The engine's connector wrapped for move-the-query (`--move-query`): `inner` must be a colocated
    connector (one without load or persist is replaced by one that does neither but reads the store when a
    route falls back to fetch). The holder part exists when `hold_bytes` > 0."""
    runner, bus, engine_id = service.runner, service.bus, service.service_id
    bs = config.block_size
    if not isinstance(inner, ColocatedConnector):
        from services.engine.node_storage import engine_node_storage

        storage = engine_node_storage(config, service)
        inner = ColocatedConnector(runner, storage, load_kv=False, persist_kv=False)
    ctx = RouteContext(
        bus=bus,
        receiver=service.receiver,
        peers=service.peers,
        area=ReplyArea(service.receiver, config.route_region_bytes, engine_id=engine_id),
        storage=inner.storage,
        engine_id=engine_id,
        sender_id=service.sender.sender_id,
        fingerprint=runner.fingerprint,
        block_size=bs,
        num_layers=int(runner.spec.num_layers),
        query_bytes_per_token=query_bytes_per_token(runner),
        partial_bytes_per_token=partial_bytes_per_token(runner),
        timeout_s=config.route_timeout_s,
        side=runner.side,
    )
    holder = None
    if config.hold_bytes > 0:
        events = ChunkEvents(bus, engine_id, seed=fingerprint_seed(runner.fingerprint), block_tokens=bs)
        budget = config.hold_bytes // runner.kv.full_block_bytes
        tenant_share = int(budget * config.hold_tenant_share)
        held = HeldChunks(
            runner.kv, block_size=bs, budget_blocks=budget, events=events, tenant_named_blocks=tenant_share
        )
        holder = HolderServer(
            runner,
            held,
            receiver=service.receiver,
            sender_id=service.sender.sender_id,
            peers=service.peers,
            engine_id=engine_id,
            fingerprint=runner.fingerprint,
            region_bytes=config.route_region_bytes,
            timeout_s=config.route_timeout_s,
        )
    return RouteConnector(
        inner,
        ctx,
        runner,
        max_query_tokens=config.max_num_batched_tokens,
        holder=holder,
        hold_min_tokens=config.hold_min_tokens,
    )

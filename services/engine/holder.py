"""The chunks a holder engine keeps (move the query): pinned blocks of its own cache, found by block hash.

A chunk is the leading full blocks of a prompt this engine prefilled: when such a request finishes, the
connector hands its first blocks over (`pin`) instead of letting the scheduler free them, so the chunk is
prefilled once and never copied. Every block hash of a chunk finds it, so a request sharing only the first
k blocks of a chunk can route over those k. Chunks live within `budget_blocks`; pinning beyond it evicts the
least recently used chunk that no route session is using and no client named. A client names a chunk with
the `kv_chunk` request extension (`name`): the request's prompt is kept as a chunk under that name (or an
existing chunk covering it takes the name), pinned until `unpin`. The index hears of each chunk as location
`held:<engine>` (BlockStored on pin, BlockRemoved on eviction, Cleared at start and stop); events that
cannot be published are logged and dropped: they only steer routing, a stale entry makes a route open fail
and the requester falls back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.background import Background
from shared.bus import Bus
from shared.errors import KvpathError
from shared.kvclient import KvEventPublisher
from shared.protocol.movequery import ChunkName, HeldChunkInfo, held_location

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 1.0


@dataclass(slots=True, eq=False)
class HeldChunk:
    block_ids: list[int]  # pinned cache blocks, in chain order
    block_hashes: list[int]
    block_size: int
    num_sessions: int = 0  # route sessions reading it (an evictable chunk has none)
    last_used: float = field(default_factory=time.monotonic)
    names: set[str] = field(default_factory=set)  # clients' names: pinned while it has one
    tenant: str = ""  # the names' tenant

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size


class HeldChunks:
    def __init__(
        self,
        kv: Any,
        *,
        block_size: int,
        budget_blocks: int,
        events: ChunkEvents | None,
        tenant_named_blocks: int | None = None,
    ) -> None:
        self.kv = kv
        self.block_size = block_size
        self.budget_blocks = budget_blocks
        # the most blocks one tenant's named (pinned) chunks may take: no tenant pins the others out
        self.tenant_named_blocks = budget_blocks if tenant_named_blocks is None else tenant_named_blocks
        self.events = events
        self.chunks: list[HeldChunk] = []
        self._by_hash: dict[int, tuple[HeldChunk, int]] = {}  # block hash -> (chunk, block index)

    @property
    def num_blocks(self) -> int:
        return sum(len(c.block_ids) for c in self.chunks)

    def find(self, chunk_hash: int, num_blocks: int) -> HeldChunk | None:
        """The chunk whose block `num_blocks - 1` hashes to `chunk_hash` (it holds blocks [0, num_blocks))."""
        entry = self._by_hash.get(chunk_hash)
        if entry is None or entry[1] != num_blocks - 1:
            return None
        return entry[0]

    def longest(self, block_hashes: Sequence[int]) -> tuple[HeldChunk | None, int]:
        """The held chunk sharing the most leading blocks with a prompt, and how many."""
        if not block_hashes or block_hashes[0] not in self._by_hash:
            return None, 0
        chunk, index = self._by_hash[block_hashes[0]]
        if index != 0:
            return None, 0
        n = 1
        while (
            n < min(len(block_hashes), len(chunk.block_hashes)) and chunk.block_hashes[n] == block_hashes[n]
        ):
            n += 1
        return chunk, n

    def pin(
        self, block_ids: list[int], block_hashes: list[int], name: ChunkName | None = None
    ) -> HeldChunk | None:
        """Take ownership of a finished request's leading blocks as a chunk; None (nothing taken) when the
        budget cannot make room, the chunk is held already, or a named pin would pass its tenant's share. A
        named pin first drops idle, unnamed chunks it overlaps (it supersedes them) and takes the name."""
        n = len(block_ids)
        if n == 0 or n != len(block_hashes):
            return None
        if name is not None:
            if self._tenant_named_after(name, None, n) > self.tenant_named_blocks:
                return None
            overlapping = self._by_hash.get(block_hashes[0], (None, 0))[0]
            if overlapping is not None and not overlapping.names and overlapping.num_sessions == 0:
                self.evict(overlapping)
        if block_hashes[0] in self._by_hash or not self._make_room(n):
            return None
        chunk = HeldChunk(list(block_ids), list(block_hashes), self.block_size)
        self.chunks.append(chunk)
        for i, h in enumerate(block_hashes):
            self._by_hash.setdefault(h, (chunk, i))
        if self.events is not None:
            self.events.stored(chunk)
        if name is not None:
            self.name(chunk, name)
        log.info("holding chunk blocks=%d hash=%016x", n, block_hashes[-1])
        return chunk

    def name(self, chunk: HeldChunk, name: ChunkName) -> bool:
        """Give `chunk` the client's name (pinning it), taking it off the chunk it named before: that one is
        evictable again unless it has other names. False (nothing changes) when the tenant's named chunks
        would pass its share of the budget."""
        if self._tenant_named_after(name, chunk, len(chunk.block_ids)) > self.tenant_named_blocks:
            return False
        for other in self.chunks:
            if other is not chunk and other.tenant == name.tenant:
                other.names.discard(name.name)
        chunk.names.add(name.name)
        chunk.tenant = name.tenant
        chunk.last_used = time.monotonic()
        return True

    def _tenant_named_after(self, name: ChunkName, chunk: HeldChunk | None, num_blocks: int) -> int:
        """The blocks of the tenant's named chunks once `chunk` (None: a new one of `num_blocks`) takes the
        name: the name leaves the chunk it named before, which stops counting if it had no other name."""
        others = (
            c for c in self.chunks if c is not chunk and c.tenant == name.tenant and c.names - {name.name}
        )
        return num_blocks + sum(len(c.block_ids) for c in others)

    def unpin(self, name: ChunkName) -> list[HeldChunk]:
        """Drop the name; a chunk left without names and route sessions is freed now. The chunks it named."""
        named = [c for c in self.chunks if c.tenant == name.tenant and name.name in c.names]
        for chunk in named:
            chunk.names.discard(name.name)
            if not chunk.names and chunk.num_sessions == 0:
                self.evict(chunk)
        return named

    def _make_room(self, num_blocks: int) -> bool:
        """Evict idle, unnamed chunks, least recently used first, until `num_blocks` more fit; none when
        they would not fit even then."""
        idle = sorted(
            (c for c in self.chunks if c.num_sessions == 0 and not c.names), key=lambda c: c.last_used
        )
        kept = self.num_blocks - sum(len(c.block_ids) for c in idle)
        if kept + num_blocks > self.budget_blocks:
            return False
        while self.num_blocks + num_blocks > self.budget_blocks:
            self.evict(idle.pop(0))
        return True

    def evict(self, chunk: HeldChunk) -> None:
        self.chunks.remove(chunk)
        for h in chunk.block_hashes:
            if self._by_hash.get(h, (None, 0))[0] is chunk:
                del self._by_hash[h]
        self.kv.free(chunk.block_ids)
        if self.events is not None:
            self.events.removed(chunk)

    def acquire(self, chunk: HeldChunk) -> None:
        chunk.num_sessions += 1
        chunk.last_used = time.monotonic()

    def release(self, chunk: HeldChunk) -> None:
        chunk.num_sessions = max(0, chunk.num_sessions - 1)
        chunk.last_used = time.monotonic()

    def infos(self, chunks: Sequence[HeldChunk] | None = None) -> list[HeldChunkInfo]:
        now_unix, now = time.time(), time.monotonic()
        return [
            HeldChunkInfo(
                chunk_hash=c.block_hashes[-1],
                num_tokens=c.num_tokens,
                num_sessions=c.num_sessions,
                last_used_unix_s=now_unix - (now - c.last_used),
                names=sorted(c.names),
                tenant=c.tenant,
            )
            for c in (self.chunks if chunks is None else chunks)
        ]


class ChunkEvents:
    """The index's view of the held chunks: location `held:<engine>`, one event source of its own."""

    def __init__(self, bus: Bus, engine_id: str, *, seed: int, block_tokens: int) -> None:
        self.location = held_location(engine_id)
        self.publisher = KvEventPublisher(bus, f"held-{engine_id}")
        self.seed = seed
        self.block_tokens = block_tokens
        self._background = Background()

    async def start(self) -> None:
        try:
            await self.publisher.start()
            await self.publisher.cleared([self.location], reason="restarted")
        except KvpathError as exc:
            log.warning("KV events unavailable for %s: %s", self.location, exc.message)

    def stored(self, chunk: HeldChunk) -> None:
        parents = [self.seed, *chunk.block_hashes[:-1]]
        self._keep(
            self.publisher.stored(self.location, chunk.block_hashes, parents, block_tokens=self.block_tokens)
        )

    def removed(self, chunk: HeldChunk) -> None:
        self._keep(self.publisher.removed(self.location, chunk.block_hashes, reason="evicted"))

    def _keep(self, publish: Any) -> None:
        async def run() -> None:
            try:
                await publish
            except KvpathError as exc:
                log.warning("held-chunk event for %s not published: %s", self.location, exc.message)

        self._background.keep(run())

    async def close(self) -> None:
        await self._background.close(grace_s=CLOSE_WAIT_S)
        try:
            await asyncio.wait_for(self.publisher.cleared([self.location], reason="released"), CLOSE_WAIT_S)
        except (KvpathError, TimeoutError) as exc:
            log.debug("Cleared for %s not published: %r", self.location, exc)

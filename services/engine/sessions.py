"""Sessions' KV kept resident in a decode engine's paged cache between turns (AMPD brief §2.2, §4.1).

When a turn of a session ends, its blocks stay in the cache (`SessionCache.keep`) instead of going back to the
free list; the session's next turn on this engine takes them (`take`) and computes only what is new. Idle
resident KV is evicted under memory pressure, the session idle longest first: `SessionAllocator` wraps the
cache's allocator for the scheduler, so a step that needs blocks evicts before it preempts. Evicted KV is not
lost: every full block was persisted to storage as it filled, so the next turn loads it from there.

Resident full blocks are announced to the index as location `hbm:<engine id>` (BlockStored when kept,
BlockRemoved when dropped or evicted, Cleared on start and stop), so the router knows how much of a prompt an
engine holds. Events that cannot be published are counted and dropped: they steer routing, never
correctness (a stale entry makes the router expect a resident prefix the engine then does not find, and
the turn loads or recomputes it).

Ownership: an entry belongs to the cache while the session is idle; `take` hands its blocks to the turn's
`Sequence`, and `keep` takes them back. The cache never frees blocks a sequence holds.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.engine import metrics
from services.engine.location_events import CLOSE_WAIT_S, LocationAnnouncer
from shared.background import Background
from shared.bus import Bus
from shared.errors import KvpathError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ResidentKv:
    """One idle session's KV: the tokens whose KV the blocks hold (the last partial block included) and the
    chained hashes of its full blocks, as announced."""

    session_id: str
    token_ids: list[int]
    block_ids: list[int]
    block_hashes: list[int]
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def common_prefix(a: Sequence[int], b: Sequence[int], *, dtype: type[np.integer[Any]] = np.int64) -> int:
    """Length of the longest common prefix of two lists of integers (vectorised): token ids, or with
    `dtype=np.uint64` block hashes."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.asarray(a[:n], dtype=dtype) != np.asarray(b[:n], dtype=dtype)
    first = int(np.argmax(differ))
    return first if differ[first] else n


class ResidentAnnouncer(LocationAnnouncer):
    """KV events of location `hbm:<engine id>`: sessions' resident full blocks."""

    def __init__(self, bus: Bus, engine_id: str, *, block_tokens: int) -> None:
        super().__init__(bus, "hbm", engine_id, block_tokens=block_tokens)

    def count_error(self, exc: KvpathError) -> None:
        metrics.SESSION_EVENT_FAILURES.inc()

    async def changed(self, removed: list[int], stored: list[int], parents: list[int]) -> None:
        """BlockRemoved for `removed`, then BlockStored for `stored`, and wait (bounded) for the index to
        apply them, so the session's next turn is routed by them."""
        await self.publish(removed, stored, parents, reason="replaced", wait_applied=True)

    async def removed(self, hashes: list[int]) -> None:
        await self.publish(hashes, (), (), reason="evicted", wait_applied=False)


class SessionCache:
    """Idle sessions' resident KV, least recently used first."""

    def __init__(self, kv: Any, announcer: ResidentAnnouncer | None) -> None:
        self.kv = kv  # the paged cache (its allocator)
        self.announcer = announcer
        self._entries: OrderedDict[str, ResidentKv] = OrderedDict()
        self.num_blocks = 0
        self._background = Background()
        metrics.SESSION_RESIDENT_BLOCKS.set_function(lambda: self.num_blocks)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> ResidentKv | None:
        return self._entries.get(session_id)

    def take(self, session_id: str) -> ResidentKv | None:
        """The session's resident KV, handed to its new turn (the cache no longer holds or evicts it)."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.num_blocks -= len(entry.block_ids)
        return entry

    def keep(self, entry: ResidentKv) -> bool:
        """Hold a turn's KV for the session's next turn. A session already holding KV (a concurrent turn of
        it finished first) keeps the longer of the two; False when that is the old one (the new blocks are
        freed)."""
        old = self._entries.get(entry.session_id)
        if old is not None:
            if old.num_tokens >= entry.num_tokens:
                self.kv.free(entry.block_ids)
                return False
            self._drop(old, announce_removed=False)
        self._entries[entry.session_id] = entry
        self.num_blocks += len(entry.block_ids)
        return True

    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` blocks, idle-longest sessions first (fewer if not enough are resident);
        return how many were freed."""
        freed = 0
        while freed < num_blocks and self._entries:
            _, entry = next(iter(self._entries.items()))
            freed += len(entry.block_ids)
            self._drop(entry, announce_removed=True)
            metrics.SESSION_EVICTIONS.inc()
            log.debug("session evicted session_id=%s blocks=%d", entry.session_id, len(entry.block_ids))
        return freed

    def _drop(self, entry: ResidentKv, *, announce_removed: bool) -> None:
        del self._entries[entry.session_id]
        self.num_blocks -= len(entry.block_ids)
        self.kv.free(entry.block_ids)
        if announce_removed and entry.block_hashes and self.announcer is not None:
            self._background.keep(self.announcer.removed(entry.block_hashes))

    def release(self, block_ids: Sequence[int]) -> None:
        """Blocks a turn took with its session's KV but does not need (past the common prefix)."""
        if block_ids:
            self.kv.free(list(block_ids))

    async def close(self) -> None:
        await self._background.close(grace_s=CLOSE_WAIT_S)
        for entry in list(self._entries.values()):
            self._drop(entry, announce_removed=False)
        if self.announcer is not None:
            await self.announcer.close()


class SessionAllocator:
    """The scheduler's block allocator on an engine with resident sessions: resident blocks count as free
    (they are evictable), and an allocation the free list cannot serve evicts idle sessions first."""

    def __init__(self, kv: Any, sessions: SessionCache) -> None:
        self.kv = kv
        self.sessions = sessions

    @property
    def num_free_blocks(self) -> int:
        return int(self.kv.num_free_blocks) + self.sessions.num_blocks

    def allocate(self, n: int) -> list[int]:
        short = n - self.kv.num_free_blocks
        if short > 0:
            self.sessions.evict(short)
        return list(self.kv.allocate(n))

    def free(self, block_ids: Sequence[int]) -> None:
        self.kv.free(block_ids)

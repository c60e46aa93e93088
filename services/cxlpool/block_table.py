"""The pool's block table (pure: no I/O, no clock of its own; the caller passes `now_ns`).

hash -> slot, with the life of a block as Beluga's single-writer / multi-reader protocol needs it:

    ALLOC (writer) -> ALLOCATED: the writer owns the slot, readers cannot see it
    COMMIT (writer, with the block's checksum) -> COMMITTED: immutable, visible to LOOKUP, under a commit
      generation unique to this commit (readers that verified a slot's bytes at a generation need not
      verify them again while LOOKUP returns that generation: the slot cannot change under it, see below)
    LOOKUP (readers) -> the longest committed prefix of a hash chain; with `pin`, a read lease keeps those
      blocks from eviction until UNPIN or the lease's expiry (a dead reader cannot pin forever)
    FREE (writer) -> its ALLOCATED blocks go back (a write that failed)

A writer whose allocation expires may still be copying into its slot (it hung, then resumed). Such a slot is
quarantined, not freed: it goes back to the free list only once that writer is known to have stopped
writing it (it commits or frees the hash, which a writer does only after its copy finished, or its client
is released as dead). So a slot is never handed out while an earlier writer can still write it, and a
committed block's bytes never change: that is what lets readers trust a generation they verified once.

Slots come from a free list ordered to spread consecutive allocations over the devices. When it runs dry,
eviction takes the least recently used *evictable* block: committed, unpinned, and a chain tail (no committed
block hangs below it; LOOKUP stops at the first missing block, so evicting from the middle of a chain would
strand everything after it). The evictable blocks are kept in their own LRU order, updated as blocks are
committed, pinned, unpinned and as their children come and go, so an eviction costs O(1).
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NO_SLOT = -1  # ALLOC: the block exists or another writer is writing it (skip it)
NO_ROOM = -2  # ALLOC: every slot is pinned, allocated or needed by the chain (nothing evictable)


class BlockState(enum.IntEnum):
    ALLOCATED = 1
    COMMITTED = 2


@dataclass(slots=True)
class Entry:
    slot: int
    state: BlockState
    owner: str  # the writer while ALLOCATED
    parent: int  # parent hash (the fingerprint seed for a chain's first block)
    expires_ns: int  # ALLOCATED: the writer's deadline to commit
    checksum: int = 0
    generation: int = 0  # COMMITTED: this commit's number (unique in the table)
    pins: int = 0
    num_children: int = 0  # committed blocks whose parent this is


@dataclass(slots=True)
class Lease:
    owner: str
    hashes: list[int]
    expires_ns: int


@dataclass(slots=True)
class TableStats:
    num_slots: int
    num_free: int = 0
    num_allocated: int = 0
    num_committed: int = 0
    num_pinned: int = 0
    num_leases: int = 0
    lookups: int = 0
    hit_blocks: int = 0
    evicted: int = 0
    expired_leases: int = 0
    expired_allocations: int = 0
    num_quarantined: int = 0  # slots of expired allocations whose writer may still be copying


@dataclass(slots=True)
class LookupResult:
    lease_id: int  # 0: nothing pinned
    slots: list[int]
    checksums: list[int]
    generations: list[int]


@dataclass(slots=True)
class BlockTable:
    num_slots: int
    order: Sequence[int] = ()  # the free list's initial order (default: 0..num_slots-1)
    first_generation: int = 1  # the first commit's generation (the pool passes its start time in ns, so
    # a restarted pool never repeats a generation of its predecessor)
    entries: dict[int, Entry] = field(default_factory=dict)
    _free: deque[int] = field(default_factory=deque)
    _evictable: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first
    _num_committed: int = 0
    _allocated: set[int] = field(default_factory=set)  # hashes being written
    _quarantine: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (writer, hash) -> slots
    _leases: dict[int, Lease] = field(default_factory=dict)
    _expiries: list[tuple[int, int]] = field(default_factory=list)  # heap of (expires_ns, lease_id)
    _next_lease: int = 1
    _next_generation: int = 0
    stats: TableStats = field(init=False)

    def __post_init__(self) -> None:
        self._free = deque(self.order or range(self.num_slots))
        self._next_generation = self.first_generation
        self.stats = TableStats(num_slots=self.num_slots)

    # ------------------------------------------------------------------------------------------ reads

    def lookup(
        self, hashes: Sequence[int], owner: str, *, pin: bool, lease_ns: int, now_ns: int
    ) -> LookupResult:
        """The longest committed prefix of the chain `hashes`; `pin` leases it to `owner` for `lease_ns`.

        The hot path of every request: one pass, locals only, no per-hit objects."""
        entries, evictable, committed = self.entries, self._evictable, BlockState.COMMITTED
        slots: list[int] = []
        checksums: list[int] = []
        generations: list[int] = []
        for h in hashes:
            entry = entries.get(h)
            if entry is None or entry.state is not committed:
                break
            slots.append(entry.slot)
            checksums.append(entry.checksum)
            generations.append(entry.generation)
            if h in evictable:
                evictable.move_to_end(h)
        self.stats.lookups += 1
        self.stats.hit_blocks += len(slots)
        lease_id = 0
        if pin and slots:
            lease_id = self._new_lease(owner, list(hashes[: len(slots)]), now_ns + lease_ns)
        return LookupResult(lease_id, slots, checksums, generations)

    def unpin(self, lease_id: int, owner: str) -> bool:
        """End a read lease (idempotent); False when it is unknown, expired or someone else's."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner:
            return False
        self._end_lease(lease_id)
        return True

    # ----------------------------------------------------------------------------------------- writes

    def alloc(
        self, hashes: Sequence[int], parents: Sequence[int], owner: str, *, lease_ns: int, now_ns: int
    ) -> tuple[list[int], list[int]]:
        """A slot per block to write: NO_SLOT where the block exists or is being written, NO_ROOM where
        nothing could be freed. Returns (slots, hashes evicted to make room)."""
        evicted: list[int] = []
        slots: list[int] = []
        for h, parent in zip(hashes, parents, strict=True):
            if h in self.entries:
                slots.append(NO_SLOT)
                continue
            if not self._free:
                evicted += self._evict(1, keep=set(hashes))
            if not self._free:
                slots.append(NO_ROOM)
                continue
            slot = self._free.popleft()
            self.entries[h] = Entry(slot, BlockState.ALLOCATED, owner, parent, now_ns + lease_ns)
            self._allocated.add(h)
            slots.append(slot)
        return slots, evicted

    def commit(self, hashes: Sequence[int], checksums: Sequence[int], owner: str) -> list[int]:
        """Publish `owner`'s allocated blocks; returns those it committed (others' or unknown: skipped).
        The writer is done copying: slots of its expired allocations of these hashes leave quarantine."""
        generations = self.commit_generations(hashes, checksums, owner)
        return [h for h, g in zip(hashes, generations, strict=True) if g]

    def commit_generations(self, hashes: Sequence[int], checksums: Sequence[int], owner: str) -> list[int]:
        """`commit`, answering each hash's new commit generation in order (0: not committed by this call)."""
        generations: list[int] = []
        for h, checksum in zip(hashes, checksums, strict=True):
            self._unquarantine(owner, h)
            entry = self.entries.get(h)
            generations.append(0)
            if entry is None or entry.state is not BlockState.ALLOCATED or entry.owner != owner:
                continue
            entry.state, entry.checksum, entry.owner = BlockState.COMMITTED, checksum, ""
            entry.generation, self._next_generation = self._next_generation, self._next_generation + 1
            self._allocated.discard(h)
            self._num_committed += 1
            parent = self.entries.get(entry.parent)
            if parent is not None and parent.state is BlockState.COMMITTED:
                parent.num_children += 1
                self._evictable.pop(entry.parent, None)  # no longer a tail
            self._evictable[h] = None
            generations[-1] = entry.generation
        return generations

    def free(self, hashes: Iterable[int], owner: str) -> int:
        """Give back `owner`'s allocated (uncommitted) blocks: its write failed."""
        freed = 0
        for h in hashes:
            freed += self._unquarantine(owner, h)
            entry = self.entries.get(h)
            if entry is not None and entry.state is BlockState.ALLOCATED and entry.owner == owner:
                self._drop(h, entry)
                freed += 1
        return freed

    # ----------------------------------------------------------------------------------- maintenance

    def expire(self, now_ns: int) -> None:
        """End read leases and writer allocations past their deadline (their client died or hung). An
        expired allocation's hash can be written again at once; its slot stays quarantined (see above)."""
        while self._expiries and self._expiries[0][0] <= now_ns:
            _, lease_id = heapq.heappop(self._expiries)
            if lease_id in self._leases:
                self._end_lease(lease_id)
                self.stats.expired_leases += 1
        stale = [h for h in self._allocated if self.entries[h].expires_ns <= now_ns]
        for h in stale:
            entry = self.entries.pop(h)
            self._allocated.discard(h)
            self._quarantine.setdefault((entry.owner, h), []).append(entry.slot)
            self.stats.expired_allocations += 1

    def release_owner(self, owner: str) -> tuple[int, int]:
        """A client died: end its leases and give back its allocations; (leases, allocations) released."""
        leases = [lid for lid, lease in self._leases.items() if lease.owner == owner]
        for lease_id in leases:
            self._end_lease(lease_id)
        allocated = [h for h in self._allocated if self.entries[h].owner == owner]
        for h in allocated:
            self._drop(h, self.entries[h])
        for key in [key for key in self._quarantine if key[0] == owner]:
            self._free.extend(self._quarantine.pop(key))
        return len(leases), len(allocated)

    def snapshot_stats(self) -> TableStats:
        s = self.stats
        s.num_free = len(self._free)
        s.num_committed = self._num_committed
        s.num_allocated = len(self.entries) - self._num_committed
        s.num_pinned = sum(1 for e in self.entries.values() if e.pins)
        s.num_leases = len(self._leases)
        s.num_quarantined = sum(len(slots) for slots in self._quarantine.values())
        return s

    # ---------------------------------------------------------------------------------------- helpers

    def _unquarantine(self, owner: str, h: int) -> int:
        """`owner` stopped writing `h`: the slots of its expired allocations of it go back."""
        slots = self._quarantine.pop((owner, h), None) if self._quarantine else None
        if not slots:
            return 0
        self._free.extend(slots)
        return len(slots)

    def _new_lease(self, owner: str, hashes: list[int], expires_ns: int) -> int:
        lease_id = self._next_lease
        self._next_lease += 1
        for h in hashes:
            self.entries[h].pins += 1
            self._evictable.pop(h, None)
        self._leases[lease_id] = Lease(owner, hashes, expires_ns)
        heapq.heappush(self._expiries, (expires_ns, lease_id))
        return lease_id

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        for h in lease.hashes:
            entry = self.entries.get(h)
            if entry is None:
                continue
            entry.pins -= 1
            if not entry.pins and not entry.num_children:
                self._evictable[h] = None  # just read: the most recently used end

    def _evict(self, count: int, *, keep: set[int]) -> list[int]:
        """Evict up to `count` evictable blocks (committed, unpinned tails), least recently used first;
        never one of `keep` (the chain being allocated)."""
        victims: list[int] = []
        for h in self._evictable:
            if len(victims) >= count:
                break
            if h not in keep:
                victims.append(h)
        for h in victims:
            self._drop(h, self.entries[h])
        self.stats.evicted += len(victims)
        return victims

    def _drop(self, h: int, entry: Entry) -> None:
        del self.entries[h]
        self._allocated.discard(h)
        if entry.state is BlockState.COMMITTED:
            self._num_committed -= 1
            self._evictable.pop(h, None)
            parent = self.entries.get(entry.parent)
            if parent is not None and parent.state is BlockState.COMMITTED:
                parent.num_children -= 1
                if not parent.num_children and not parent.pins:
                    self._evictable[entry.parent] = None
                    self._evictable.move_to_end(entry.parent, last=False)  # as old as the tail it led to
        self._free.append(entry.slot)

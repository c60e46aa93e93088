"""The engine-local super-block cache of the remote tier (LMCache's `local_cpu` backend), and the super-block
arithmetic. Pure bookkeeping: no bytes, no I/O.

Super blocks: with `chunk_blocks` blocks per super block (256 tokens / 64-token blocks = 4), super block c
holds blocks [c * chunk_blocks, (c + 1) * chunk_blocks) and is keyed by the chained hash of its LAST block,
which names the whole prefix up to it (`shared.hashing`). Only whole super blocks are stored or hit, so a hit
rounds down to a multiple of `chunk_blocks` blocks and a partial super block at the end is never written:
the baseline's granularity cost.

The cache: `num_slots` slots of one super block each in an arena the tier owns. An entry is FILLING (bytes
on their way: a GET landing, or not yet published) or READY; only READY entries are hits. Pins (readers
copying out, an upload reading the slot, the filler itself) keep an entry from being evicted; eviction takes
the least recently used READY entry nobody pins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def whole_chunks(num_blocks: int, chunk_blocks: int) -> int:
    """Super blocks wholly inside the first `num_blocks` blocks (hits round down to these)."""
    return max(0, num_blocks) // chunk_blocks


def chunk_keys(block_hashes: Sequence[int], num_blocks: int, chunk_blocks: int) -> list[int]:
    """Keys of the whole super blocks in the first `num_blocks` blocks: each one's last block hash."""
    n = whole_chunks(min(num_blocks, len(block_hashes)), chunk_blocks)
    return [block_hashes[(c + 1) * chunk_blocks - 1] for c in range(n)]


def completed_chunks(start: int, end: int, chunk_blocks: int) -> range:
    """Super blocks whose last block lies in blocks [start, end): they became whole when those filled."""
    return range(start // chunk_blocks, end // chunk_blocks)


@dataclass(slots=True, eq=False)
class CacheEntry:
    key: int
    slot: int
    block_hashes: list[int]  # the super block's blocks (announced as the engine's `dram:` location)
    parent_hash: int = 0  # the hash before its first block (the chain's seed for super block 0)
    is_ready: bool = False
    num_pins: int = 1  # the filler's pin, until it publishes or drops the entry


class SuperBlockCache:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a super-block cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()  # least recently used first
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_ready(self) -> int:
        return sum(1 for e in self._entries.values() if e.is_ready)

    def get(self, key: int) -> CacheEntry | None:
        return self._entries.get(key)

    def ready_prefix(self, keys: Sequence[int]) -> int:
        """How many leading keys are READY here."""
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or not entry.is_ready:
                return i
        return len(keys)

    def pin(self, keys: Sequence[int]) -> list[CacheEntry]:
        """Pin READY entries (a reader copies them out) and mark them used."""
        out = []
        for key in keys:
            entry = self._entries[key]
            assert entry.is_ready, "only ready entries are read"
            entry.num_pins += 1
            self._entries.move_to_end(key)
            out.append(entry)
        return out

    def unpin(self, entries: Sequence[CacheEntry]) -> None:
        for entry in entries:
            if entry.num_pins > 0:
                entry.num_pins -= 1

    def reserve(
        self, key: int, block_hashes: list[int], parent_hash: int = 0
    ) -> tuple[CacheEntry | None, list[CacheEntry]]:
        """A FILLING entry (pinned by the caller) for a key not held here, evicting LRU entries when no slot
        is free: (entry, evicted entries); entry None when every slot is pinned."""
        assert key not in self._entries, "reserve a key only when the cache lacks it"
        evicted: list[CacheEntry] = []
        if not self._free_slots:
            victim = next((e for e in self._entries.values() if e.is_ready and e.num_pins == 0), None)
            if victim is None:
                return None, evicted
            del self._entries[victim.key]
            self._free_slots.append(victim.slot)
            self.num_evicted += 1
            evicted.append(victim)
        entry = CacheEntry(key, self._free_slots.pop(), block_hashes, parent_hash)
        self._entries[key] = entry
        return entry, evicted

    def publish(self, entry: CacheEntry) -> None:
        """The entry's bytes are in its slot: it is a hit from now on (the filler keeps its pin)."""
        entry.is_ready = True
        self._entries.move_to_end(entry.key)

    def drop(self, entry: CacheEntry) -> None:
        """Give a FILLING entry's slot back (its fill failed; no one else knows it)."""
        if self._entries.get(entry.key) is entry and not entry.is_ready:
            del self._entries[entry.key]
            self._free_slots.append(entry.slot)

"""LRU catalog of the block files a storage service accounts for, against a capacity in bytes.

Pure bookkeeping: the service decides what to delete. With a shared root each node accounts only for the
files it wrote (its share of the root); see `service.py` for how eviction consults file mtimes then.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BlockKey = tuple[int, int]  # (fingerprint hash, block hash)


@dataclass(slots=True)
class LruEntry:
    file_bytes: int
    last_access_s: float


@dataclass(slots=True)
class LruCatalog:
    capacity_bytes: int  # 0: unlimited
    used_bytes: int = 0
    _entries: OrderedDict[BlockKey, LruEntry] = field(default_factory=OrderedDict)  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def add(self, key: BlockKey, file_bytes: int, now_s: float) -> None:
        """Account for a file (or refresh it) as most recently used."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old.file_bytes
        self._entries[key] = LruEntry(file_bytes, now_s)
        self.used_bytes += file_bytes

    def touch(self, key: BlockKey, now_s: float) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.last_access_s = max(entry.last_access_s, now_s)
        self._entries.move_to_end(key)
        return True

    def remove(self, key: BlockKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= entry.file_bytes
        return True

    def fits(self, file_bytes: int) -> bool:
        """Whether `file_bytes` more fit without evicting."""
        return self.capacity_bytes <= 0 or self.used_bytes + file_bytes <= self.capacity_bytes

    def can_ever_fit(self, file_bytes: int) -> bool:
        return self.capacity_bytes <= 0 or file_bytes <= self.capacity_bytes

    def pop_lru(self) -> tuple[BlockKey, LruEntry] | None:
        """Remove and return the least recently used entry (an eviction candidate)."""
        if not self._entries:
            return None
        key, entry = self._entries.popitem(last=False)
        self.used_bytes -= entry.file_bytes
        return key, entry

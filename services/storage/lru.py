"""LRU catalog of the block files a storage service accounts for, against a capacity in bytes.

Pure bookkeeping: the service decides what to delete. With a shared root each node accounts only for the
files it wrote (its share of the root); see `service.py` for how eviction consults file mtimes then.

Eviction takes chain tails first: a block is a candidate only while no block of its chain that follows it is
kept (its children count is 0, as in vLLM's free queue), so a prompt's cached prefix shrinks from its end and
never loses a middle block that would make everything after it unreachable. Pins keep a block from eviction,
counted (one per holder): a block being written is pinned until its write settles (the writer owns it until
then), and every block of a write request until the request's BlockStored event is in the stream (evicting
it before would publish its BlockRemoved first, and the index would keep a block that is gone); every pin is
matched by one unpin, also across a removal of the entry. Parents are known for blocks written since the
service started; files found by the startup scan have none and age by their mtime.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BlockKey = tuple[int, int]  # (fingerprint hash, block hash)


@dataclass(slots=True)
class LruEntry:
    file_bytes: int
    last_access_s: float
    parent: BlockKey | None = None
    children: int = 0  # entries whose parent this one is


@dataclass(slots=True)
class LruCatalog:
    capacity_bytes: int  # 0: unlimited
    used_bytes: int = 0
    _entries: OrderedDict[BlockKey, LruEntry] = field(default_factory=OrderedDict)  # LRU first
    _orphans: dict[BlockKey, int] = field(default_factory=dict)  # absent parent -> entries waiting for it
    _pinned: dict[BlockKey, int] = field(default_factory=dict)  # key -> holders of a pin

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def size_of(self, key: BlockKey) -> int:
        """Bytes accounted for `key` (0: not in the catalog)."""
        entry = self._entries.get(key)
        return entry.file_bytes if entry is not None else 0

    def add(self, key: BlockKey, file_bytes: int, now_s: float, parent: BlockKey | None = None) -> None:
        """Account for a file (or refresh it) as most recently used; `parent`: its chain's previous block."""
        old = self._entries.get(key)
        if old is not None:
            old.last_access_s = max(old.last_access_s, now_s)
            self.used_bytes += file_bytes - old.file_bytes
            old.file_bytes = file_bytes
            self._entries.move_to_end(key)
            return
        entry = LruEntry(file_bytes, now_s, parent, self._orphans.pop(key, 0))
        if parent is not None:
            up = self._entries.get(parent)
            if up is not None:
                up.children += 1
            else:
                self._orphans[parent] = self._orphans.get(parent, 0) + 1
        self._entries[key] = entry
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
        self._forget(key, entry)  # its pins stay with their holders, who unpin them
        return True

    def pin(self, key: BlockKey) -> None:
        """Keep `key` out of eviction until the matching `unpin` (pins are counted, one per holder)."""
        self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, key: BlockKey) -> None:
        left = self._pinned.get(key, 0) - 1
        if left > 0:
            self._pinned[key] = left
        else:
            self._pinned.pop(key, None)

    def fits(self, file_bytes: int) -> bool:
        """Whether `file_bytes` more fit without evicting."""
        return self.capacity_bytes <= 0 or self.used_bytes + file_bytes <= self.capacity_bytes

    def free_bytes(self) -> int | None:
        """Bytes left before eviction is needed; None when unlimited."""
        return None if self.capacity_bytes <= 0 else max(0, self.capacity_bytes - self.used_bytes)

    def can_ever_fit(self, file_bytes: int) -> bool:
        return self.capacity_bytes <= 0 or file_bytes <= self.capacity_bytes

    def pop_lru(self) -> tuple[BlockKey, LruEntry] | None:
        """Remove and return the least recently used chain tail that is not pinned (an eviction candidate);
        None when every entry is pinned or has a kept child."""
        for key, entry in self._entries.items():
            if entry.children == 0 and key not in self._pinned:
                del self._entries[key]
                self._forget(key, entry)
                return key, entry
        return None

    def _forget(self, key: BlockKey, entry: LruEntry) -> None:
        self.used_bytes -= entry.file_bytes
        if entry.children:  # its children wait for it again (it may be re-added)
            self._orphans[key] = self._orphans.get(key, 0) + entry.children
        if entry.parent is None:
            return
        up = self._entries.get(entry.parent)
        if up is not None:
            up.children -= 1
            return
        left = self._orphans.get(entry.parent, 0) - 1
        if left > 0:
            self._orphans[entry.parent] = left
        else:
            self._orphans.pop(entry.parent, None)

"""A compact uint64 -> uint64 hash map in numpy arrays (open addressing, linear probing, tombstones).

17 bytes per slot (key, value, state) at a load factor of at most 1/2: about 35 bytes per entry, against
~100 for a Python dict of ints. Every operation takes a batch of keys and runs as a few numpy passes per
probe step, so a 512-hash lookup costs tens of microseconds and no Python loop runs per key.
Keys are block hashes (already uniform); a Fibonacci multiply picks the home slot from the high bits.

Invariant (what lets `prefix_values` trust one row compare): a slot without a live entry holds a key that is
not homed in its bucket (`_vacant_key`: 0, or 1 in bucket 0, the only bucket key 0 is homed in), so a key
occurs at most once in its home bucket's row, and only as a live entry.
"""

from __future__ import annotations

import numpy as np

_EMPTY, _FULL, _TOMB = np.uint8(0), np.uint8(1), np.uint8(2)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MAX_LOAD = 0.5
_MIN_CAPACITY = 1024
_BUCKET_BITS = 3
_BUCKET = 1 << _BUCKET_BITS  # slots per home bucket: one 64-byte line of keys
_LINE = 64  # bytes: arrays start on a cache line, so a bucket's keys are one line, not two


def _zeros_aligned(size: int, dtype: type[np.generic]) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(size * itemsize + _LINE, dtype=np.uint8)
    start = -raw.ctypes.data % _LINE
    return raw[start : start + size * itemsize].view(dtype)


def _vacant_key(slots: np.ndarray) -> np.ndarray:
    """The key a slot holds once it holds no entry: one not homed in its bucket (see the invariant)."""
    return (slots < _BUCKET).astype(np.uint64)  # home(1) is never bucket 0 (the multiplier's top bit is 1)


def _pow2_at_least(n: int) -> int:
    return max(_MIN_CAPACITY, 1 << max(0, int(n - 1).bit_length()))


class U64Table:
    """Map uint64 keys to non-zero uint64 values; a value that becomes 0 deletes its key."""

    __slots__ = (
        "_bits",
        "_bucket_shift",
        "_key_rows",
        "_state_rows",
        "keys",
        "num_live",
        "num_tombstones",
        "states",
        "values",
    )

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        self._allocate(_pow2_at_least(capacity))

    def _allocate(self, capacity: int) -> None:
        self._bits = capacity.bit_length() - 1
        self.keys = _zeros_aligned(capacity, np.uint64)
        self.keys[:_BUCKET] = 1  # vacant slots of bucket 0 (`_vacant_key`)
        self.values = _zeros_aligned(capacity, np.uint64)
        self._key_rows = self.keys.reshape(-1, _BUCKET)  # a view: bucket b is row b
        self._bucket_shift = np.uint64(64 - self._bits + _BUCKET_BITS)
        self.states = _zeros_aligned(capacity, np.uint8)
        self._state_rows = self.states.reshape(-1, _BUCKET)
        self.num_live = 0
        self.num_tombstones = 0

    @property
    def capacity(self) -> int:
        return int(self.states.size)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes + self.states.nbytes)

    def __len__(self) -> int:
        return self.num_live

    def _home(self, keys: np.ndarray) -> np.ndarray:
        """First slot of each key's probe: the start of its bucket of `_BUCKET` slots (a 64-byte line of
        keys), so `prefix_values` reads a key's likeliest slots as one row of `_key_rows`."""
        return self._home_bucket(keys).astype(np.int64) << _BUCKET_BITS

    def _home_bucket(self, keys: np.ndarray) -> np.ndarray:
        return (keys * _GOLDEN) >> self._bucket_shift

    # -------------------------------------------------------------------------------------- queries

    def find(self, keys: np.ndarray, *, prefix_only: bool = False) -> np.ndarray:
        """Slot of each key, -1 where absent.

        `prefix_only`: only the keys before the first absent one matter (a prefix match); probing stops
        for every later key as soon as an earlier key is known to be absent, and those report -1.
        """
        result = np.full(keys.size, -1, dtype=np.int64)
        if keys.size == 0 or self.num_live == 0:
            return result
        mask = self.capacity - 1
        idx = np.arange(keys.size)
        pos = self._home(keys)
        while idx.size:
            states = self.states[pos]
            hit = (states == _FULL) & (self.keys[pos] == keys[idx])
            result[idx[hit]] = pos[hit]
            absent = states == _EMPTY
            go_on = ~hit & ~absent
            if prefix_only and absent.any():
                go_on &= idx < idx[absent].min()
            idx, pos = idx[go_on], (pos[go_on] + 1) & mask
        return result

    def prefix_values(self, keys: np.ndarray) -> np.ndarray:
        """Values of the leading present keys of a chain (stops at the first absent one).

        The hot path of a prefix match: nine numpy calls for the whole chain and no Python per key. Each
        key's home bucket is read as one row (`take` of a contiguous 2D view, one cache line) and compared
        with the key; by the module's invariant a key matches at most once in that row and only where it
        is live, so as many matches as keys means every key is present in its home bucket (the common
        case at load <= 1/2). Otherwise `_resolve_prefix` finds the first key outside its bucket.
        Both gathers use `mode="clip"`: a home bucket and a slot in it are in range by construction, and
        the default bounds check ("raise") costs ~0.3 us per `take` of 512.
        """
        if keys.size == 0 or self.num_live == 0:
            return np.zeros(0, dtype=np.uint64)
        buckets = keys * _GOLDEN  # the home buckets, in place from here on (no temporaries)
        buckets >>= self._bucket_shift
        slots = buckets.view(np.int64)
        match = self._key_rows.take(slots, axis=0, mode="clip") == keys[:, None]
        if np.count_nonzero(match) != keys.size:
            return self._resolve_prefix(keys, slots, match)
        slots <<= _BUCKET_BITS
        slots += match.argmax(axis=1)
        return self.values.take(slots, mode="clip")

    def _resolve_prefix(self, keys: np.ndarray, buckets: np.ndarray, match: np.ndarray) -> np.ndarray:
        """`prefix_values` when some key is not in its home bucket: absent, or pushed into a later one."""
        in_bucket = match.any(axis=1)
        first = int(np.argmin(in_bucket))  # the first key not in its home bucket
        slots = (buckets[:first] << _BUCKET_BITS) + match[:first].argmax(axis=1)
        values = self.values.take(slots)
        if (self._state_rows[buckets[first]] == _EMPTY).any():
            return values  # probing stops at an empty slot: this key is absent
        rest = self.find(keys[first:], prefix_only=True)
        absent = rest < 0
        end = int(np.argmax(absent)) if absent.any() else rest.size
        return np.concatenate((values, self.values[rest[:end]]))

    def get(self, keys: np.ndarray, *, prefix_only: bool = False) -> np.ndarray:
        """Value of each key, 0 where absent (see `find` for `prefix_only`)."""
        slots = self.find(keys, prefix_only=prefix_only)
        out = np.zeros(keys.size, dtype=np.uint64)
        found = slots >= 0
        out[found] = self.values[slots[found]]
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of every live entry (copies)."""
        live = self.states == _FULL
        return self.keys[live].copy(), self.values[live].copy()

    # ------------------------------------------------------------------------------------ mutations

    def or_values(self, keys: np.ndarray, bits: int) -> int:
        """values[key] |= bits, inserting absent keys; return how many keys were new."""
        keys = np.unique(keys)
        slots = self.find(keys)
        found = slots >= 0
        self.values[slots[found]] |= np.uint64(bits)
        new = keys[~found]
        if new.size:
            self.insert_new(new, np.full(new.size, bits, dtype=np.uint64))
        return int(new.size)

    def clear_bits(self, keys: np.ndarray, bits: int) -> int:
        """values[key] &= ~bits for present keys; keys left with 0 are deleted. Return how many were."""
        slots = self.find(np.unique(keys))
        slots = slots[slots >= 0]
        self.values[slots] &= ~np.uint64(bits)
        return self._delete_zeros(slots)

    def clear_bits_everywhere(self, bits: int) -> int:
        """Clear `bits` in every entry (a Cleared location); return how many entries were deleted."""
        slots = np.flatnonzero(self.states == _FULL)
        self.values[slots] &= ~np.uint64(bits)
        return self._delete_zeros(slots)

    def _delete_zeros(self, slots: np.ndarray) -> int:
        dead = slots[self.values[slots] == 0]
        self.states[dead] = _TOMB
        self.keys[dead] = _vacant_key(dead)
        self.num_live -= int(dead.size)
        self.num_tombstones += int(dead.size)
        return int(dead.size)

    def insert_new(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Insert keys known to be absent and unique (values non-zero), growing the table first if needed."""
        if self.num_live + self.num_tombstones + keys.size > _MAX_LOAD * self.capacity:
            self._rehash(self.num_live + keys.size)
        mask = self.capacity - 1
        idx = np.arange(keys.size)
        pos = self._home(keys)
        while idx.size:
            free = self.states[pos] != _FULL
            cand_pos, cand_idx = pos[free], idx[free]
            slots, first = np.unique(cand_pos, return_index=True)  # one winner per free slot
            winners = cand_idx[first]
            self.num_tombstones -= int(np.count_nonzero(self.states[slots] == _TOMB))
            self.keys[slots], self.values[slots], self.states[slots] = keys[winners], values[winners], _FULL
            self.num_live += int(slots.size)
            placed = np.zeros(keys.size, dtype=bool)
            placed[winners] = True
            left = ~placed[idx]
            idx, pos = idx[left], (pos[left] + 1) & mask

    def _rehash(self, num_entries: int) -> None:
        keys, values = self.items()
        self._allocate(_pow2_at_least(int(num_entries / _MAX_LOAD) + 1))
        if keys.size:
            self.insert_new(keys, values)

"""A compact uint64 -> uint64 hash map in numpy arrays (open addressing in buckets, tombstones).

17 bytes per slot (key, value, state) at a load factor of at most 1/2: about 35 bytes per entry, against
~100 for a Python dict of ints. Every operation takes a batch of keys and runs as a few numpy passes, so a
512-hash lookup costs a few microseconds and no Python loop runs per key. Keys are block hashes (already
uniform); a Fibonacci multiply picks each key's own slot from the high bits, and its home bucket is the
`_BUCKET` slots (one 64-byte line of keys) that slot lies in.

Placement: a key goes into its own slot if that is free; else into any free slot of its home bucket; else
into the first later bucket (wrapping) with a free slot, and then also into the stash, a dict of key ->
slot for the live keys outside their home bucket (about 1 in 500 at load 1/2, ~100 bytes each: under a
byte per entry). So about 4 keys in 5 sit in their own slot, a lookup compares one key per key, finds
the rest in their home buckets' rows, and asks the stash only for the few not there: a key in neither is
absent, with no search past its home bucket.

Invariant (what lets a lookup trust one compare): a slot without a live entry holds a key that is not
homed in its bucket (`_vacant_key`: 0, or 1 in bucket 0, the only bucket key 0 is homed in), so a key
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
        "_key_rows",
        "_slot_shift",
        "_stash",
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
        self._slot_shift = np.uint64(64 - self._bits)
        self.states = _zeros_aligned(capacity, np.uint8)
        self._state_rows = self.states.reshape(-1, _BUCKET)
        self._stash: dict[int, int] = {}  # key -> slot of each live key outside its home bucket
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
        """Each key's own slot (a new int64 array): the top bits of the key times the golden ratio."""
        slots = keys * _GOLDEN
        slots >>= self._slot_shift
        return slots.view(np.int64)

    def _home_bucket(self, keys: np.ndarray) -> np.ndarray:
        return self._home(keys) >> _BUCKET_BITS

    # -------------------------------------------------------------------------------------- queries

    def find(self, keys: np.ndarray, *, prefix_only: bool = False) -> np.ndarray:
        """Slot of each key, -1 where absent.

        `prefix_only`: only the keys before the first absent one matter (a prefix match); every later key
        reports -1.
        """
        if keys.size == 0 or self.num_live == 0:
            return np.full(keys.size, -1, dtype=np.int64)
        slots = self._home(keys)
        at_home = self.keys.take(slots, mode="clip") == keys
        if np.count_nonzero(at_home) == keys.size:
            return slots
        beyond = self._in_home_rows(keys, slots, at_home)
        if beyond is None:
            return slots
        buckets = slots[beyond] >> _BUCKET_BITS
        slots[beyond] = -1
        # a key stored past its home bucket found the bucket full, and a bucket never gets an empty slot
        # back (a removal leaves a tombstone): a key whose home bucket has one is absent, not looked up
        empty = self._state_rows.take(buckets, axis=0, mode="clip") == _EMPTY
        for pos, key in zip(*self._listed(keys, beyond[empty.view(np.uint64).reshape(-1) == 0]), strict=True):
            slots[pos] = self._stash.get(key, -1)
        if prefix_only and (absent := slots < 0).any():
            slots[int(np.argmax(absent)) :] = -1
        return slots

    def _in_home_rows(self, keys: np.ndarray, slots: np.ndarray, at_home: np.ndarray) -> np.ndarray | None:
        """For the keys not in their own slot (`away`, positions in `keys`), look in their home buckets'
        rows (one `take` of a contiguous 2D view, one cache line each): set `slots[away]` to where each
        is found there and return the positions of those that are not (None: none), whose `slots`
        entries are then their bucket's first slot, to be overwritten."""
        away = (~at_home).nonzero()[0]
        buckets = slots[away] >> _BUCKET_BITS
        rows = self._key_rows.take(buckets, axis=0, mode="clip") == keys[away][:, None]
        offsets = rows.argmax(axis=1)  # each key's slot in its home bucket's row (0 where it is not there)
        buckets <<= _BUCKET_BITS
        buckets += offsets
        slots[away] = buckets
        if np.count_nonzero(rows) == away.size:  # the usual case: each is elsewhere in its home bucket
            return None
        return away[rows.view(np.uint64).reshape(-1) == 0]  # 8 bools as one word: not in the home bucket

    def prefix_values(self, keys: np.ndarray) -> np.ndarray:
        """Values of the leading present keys of a chain (stops at the first absent one).

        The hot path of a prefix match: about fifteen numpy calls for the whole chain and no Python per
        key. By the module's invariant a key matches its own slot only where it lives, so as many matches
        as keys means every key is found. Otherwise the others (~1 in 5) are looked up in their home
        buckets' rows, and the few outside it (~1 in 500) in the stash. Gathers use `mode="clip"`: every
        index is in range by construction, and the default bounds check ("raise") costs ~0.3 us per
        `take` of 512.
        """
        if keys.size == 0 or self.num_live == 0:
            return np.zeros(0, dtype=np.uint64)
        slots = self._home(keys)
        at_home = self.keys.take(slots, mode="clip") == keys
        if np.count_nonzero(at_home) != keys.size:
            if (beyond := self._in_home_rows(keys, slots, at_home)) is not None:
                slots = self._stashed_prefix(keys, slots, beyond)
        return self.values.take(slots, mode="clip")

    @staticmethod
    def _listed(keys: np.ndarray, positions: np.ndarray | None) -> tuple[list[int], list[int]]:
        if positions is None:
            return [], []
        return positions.tolist(), keys[positions].tolist()

    def _stashed_prefix(self, keys: np.ndarray, slots: np.ndarray, beyond: np.ndarray) -> np.ndarray:
        """`slots` up to the first absent key, the keys at positions `beyond` (ascending) being not in
        their home buckets: each is in the stash, or absent (a chain running into unknown blocks stops at
        its first such key, so this loop is short either way)."""
        stash = self._stash
        for pos, key in zip(*self._listed(keys, beyond), strict=True):
            slot = stash.get(key)
            if slot is None:
                return slots[:pos]
            slots[pos] = slot
        return slots

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
        if self._stash:
            dead_keys = self.keys[dead]
            outside = self._home_bucket(dead_keys) != dead >> _BUCKET_BITS
            for key in dead_keys[outside].tolist():
                del self._stash[key]
        self.states[dead] = _TOMB
        self.keys[dead] = _vacant_key(dead)
        self.num_live -= int(dead.size)
        self.num_tombstones += int(dead.size)
        return int(dead.size)

    def insert_new(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Insert keys known to be absent and unique (values non-zero), growing the table first if needed.

        Own slots first (one winner per slot), then rounds over bucket rows: each key left takes the first
        free slot of its bucket (one winner per slot; the others try that bucket again), and a key whose
        bucket has no free slot moves on to the next."""
        if self.num_live + self.num_tombstones + keys.size > _MAX_LOAD * self.capacity:
            self._rehash(self.num_live + keys.size)
        slots = self._home(keys)
        idx = np.flatnonzero(self.states[slots] != _FULL)
        placed = self._fill(keys, values, idx, slots[idx])
        idx = np.flatnonzero(~placed)
        buckets = slots[idx] >> _BUCKET_BITS
        last = self.capacity // _BUCKET - 1
        while idx.size:
            free = self._state_rows[buckets] != _FULL
            room = free.any(axis=1)
            tried, chosen = idx[room], (buckets[room] << _BUCKET_BITS) + free[room].argmax(axis=1)
            placed = self._fill(keys, values, tried, chosen)
            if (outside := placed[tried] & (chosen >> _BUCKET_BITS != slots[tried] >> _BUCKET_BITS)).any():
                self._stash.update(zip(keys[tried[outside]].tolist(), chosen[outside].tolist(), strict=True))
            buckets[~room] = (buckets[~room] + 1) & last
            left = ~placed[idx]
            idx, buckets = idx[left], buckets[left]

    def _fill(self, keys: np.ndarray, values: np.ndarray, idx: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Store keys[idx] at `slots` (free ones), the first of several keys per slot winning; return a mask
        over `keys` of the winners."""
        slots, first = np.unique(slots, return_index=True)
        winners = idx[first]
        self.num_tombstones -= int(np.count_nonzero(self.states[slots] == _TOMB))
        self.keys[slots], self.values[slots], self.states[slots] = keys[winners], values[winners], _FULL
        self.num_live += int(slots.size)
        placed = np.zeros(keys.size, dtype=bool)
        placed[winners] = True
        return placed

    def _rehash(self, num_entries: int) -> None:
        keys, values = self.items()
        self._allocate(_pow2_at_least(int(num_entries / _MAX_LOAD) + 1))
        if keys.size:
            self.insert_new(keys, values)

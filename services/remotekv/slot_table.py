"""The remote KV store's core: slots of one region, a key table, publication and LRU eviction. Pure.

The region holds `num_slots` super blocks of `chunk_bytes` each (slot i at `i * slot_stride_bytes`). A key
(the chained hash of a super block's last block) moves FREE -> ALLOCATED (a PUT reserved a slot; a writer is
filling it one-sidedly) -> COMMITTED (readable); a reader never sees an ALLOCATED key, so never half-written
bytes. A reservation not committed by its deadline gives its slots back. Keys are independent (as in
Mooncake's store): the chain structure of block hashes plays no part here, and a GET asks for a prefix only
because a prompt's KV is useful only as a prefix.

Eviction: when no slot is free, a PUT takes the least recently used COMMITTED key that no GET is writing out
(pinned). ALLOCATED keys are never evicted (their writer owns them until commit or deadline).

Geometry: the store does not know the model. The first PUT's (fingerprint, chunk_bytes) is adopted; a PUT of
another format is refused while the store holds anything, and re-adopted once it is empty.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.errors import InvalidRequestError

SLOT_ALIGNMENT_BYTES = 4096  # slots start on page boundaries (views, RDMA registrations)


@dataclass(slots=True)
class Chunk:
    """One key's slot. `put_id` is the reservation that owns it until it is committed."""

    key: int
    slot: int
    put_id: int
    is_committed: bool = False
    num_readers: int = 0  # GETs writing it out now: not evictable
    checksum: int = 0  # as committed (0: none given)


@dataclass(slots=True)
class Reservation:
    put_id: int
    keys: list[int]
    expires_at_s: float  # monotonic


@dataclass(slots=True)
class ReserveResult:
    put_id: int  # 0: nothing reserved
    offsets: list[int]  # per key, -1 unless reserved
    outcomes: list[str]  # per key: ok | exists | full
    evicted_keys: list[int] = field(default_factory=list)


class SlotTable:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.fingerprint = ""
        self.chunk_bytes = 0
        self.slot_stride_bytes = 0
        self.num_slots = 0
        self._free_slots: list[int] = []
        self._chunks: dict[int, Chunk] = {}  # key -> chunk (allocated or committed)
        self._lru: OrderedDict[int, None] = OrderedDict()  # committed keys, least recently used first
        self._reservations: dict[int, Reservation] = {}
        self._put_ids = itertools.count(1)
        self.num_evicted = 0

    # ------------------------------------------------------------------------------------ accounting

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def num_committed(self) -> int:
        return len(self._lru)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots in use (allocated or committed)."""
        return len(self._chunks) * self.chunk_bytes

    def offset(self, slot: int) -> int:
        return slot * self.slot_stride_bytes

    def region_bytes(self) -> int:
        """The region size the slots need (at most `capacity_bytes`)."""
        return self.num_slots * self.slot_stride_bytes

    # ---------------------------------------------------------------------------------------- format

    def adopt(self, fingerprint: str, chunk_bytes: int) -> None:
        """Use this KV format and super-block size; refused (InvalidRequestError) while the store holds
        super blocks of another one."""
        if (fingerprint, chunk_bytes) == (self.fingerprint, self.chunk_bytes):
            return
        if self._chunks:
            raise InvalidRequestError(
                f"store holds super blocks of {self.chunk_bytes} bytes for format {self.fingerprint!r}; "
                f"got {chunk_bytes} bytes for {fingerprint!r}",
                param="chunk_bytes",
            )
        stride = -(-chunk_bytes // SLOT_ALIGNMENT_BYTES) * SLOT_ALIGNMENT_BYTES
        if chunk_bytes <= 0 or stride > self.capacity_bytes:
            raise InvalidRequestError(
                f"chunk_bytes={chunk_bytes} does not fit the store's {self.capacity_bytes} bytes",
                param="chunk_bytes",
            )
        self.fingerprint, self.chunk_bytes, self.slot_stride_bytes = fingerprint, chunk_bytes, stride
        self.num_slots = self.capacity_bytes // stride
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() hands out low slots first

    def holds_format(self, fingerprint: str, chunk_bytes: int) -> bool:
        return (fingerprint, chunk_bytes) == (self.fingerprint, self.chunk_bytes)

    # ------------------------------------------------------------------------------------------- put

    def reserve(self, keys: Sequence[int], *, now_s: float, ttl_s: float) -> ReserveResult:
        """Reserve a slot per key the store lacks (evicting LRU committed keys when full)."""
        for key in keys:  # held keys count as used now, so this PUT never evicts them
            if key in self._lru:
                self._lru.move_to_end(key)
        put_id = next(self._put_ids)
        result = ReserveResult(put_id, [-1] * len(keys), ["full"] * len(keys))
        reserved: list[int] = []
        for i, key in enumerate(keys):
            if key in self._chunks:
                result.outcomes[i] = "exists"
                continue
            slot = self._take_slot(result.evicted_keys)
            if slot is None:
                continue
            self._chunks[key] = Chunk(key, slot, put_id)
            result.offsets[i], result.outcomes[i] = self.offset(slot), "ok"
            reserved.append(key)
        if reserved:
            self._reservations[put_id] = Reservation(put_id, reserved, now_s + ttl_s)
        else:
            result.put_id = 0
        return result

    def _take_slot(self, evicted: list[int]) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((k for k in self._lru if self._chunks[k].num_readers == 0), None)
        if victim is None:
            return None
        del self._lru[victim]
        chunk = self._chunks.pop(victim)
        evicted.append(victim)
        self.num_evicted += 1
        return chunk.slot

    def commit(self, put_id: int, keys: Sequence[int], checksums: Sequence[int] = ()) -> tuple[int, int]:
        """Publish `keys` of reservation `put_id` (with their `checksums`, when given), give its other slots
        back: (committed, released)."""
        reservation = self._reservations.pop(put_id, None)
        if reservation is None:  # unknown, or expired (its slots are gone): nothing to publish
            return 0, 0
        wanted = dict(zip(keys, checksums or [0] * len(keys), strict=True))
        committed = released = 0
        for key in reservation.keys:
            chunk = self._chunks.get(key)
            if chunk is None or chunk.put_id != put_id or chunk.is_committed:
                continue
            if key in wanted:
                chunk.is_committed, chunk.checksum = True, wanted[key]
                self._lru[key] = None
                committed += 1
            else:
                self._free(key)
                released += 1
        return committed, released

    def reap(self, now_s: float) -> int:
        """Give back the slots of reservations past their deadline (their writer died or gave up)."""
        expired = [r for r in self._reservations.values() if r.expires_at_s <= now_s]
        for reservation in expired:
            self.commit(reservation.put_id, ())
        return len(expired)

    def _free(self, key: int) -> None:
        chunk = self._chunks.pop(key)
        self._lru.pop(key, None)
        self._free_slots.append(chunk.slot)

    # ------------------------------------------------------------------------------------------- get

    def exists(self, keys: Sequence[int]) -> list[bool]:
        """Which keys are committed (readable)."""
        chunks = self._chunks
        return [key in chunks and chunks[key].is_committed for key in keys]

    def prefix_len(self, keys: Sequence[int]) -> int:
        held = self.exists(keys)
        return held.index(False) if False in held else len(held)

    def pin_prefix(self, keys: Sequence[int]) -> list[int]:
        """Offsets of the leading committed keys, pinned (not evictable) until `unpin`; marks them used."""
        offsets = []
        for key in keys[: self.prefix_len(keys)]:
            chunk = self._chunks[key]
            chunk.num_readers += 1
            self._lru.move_to_end(key)
            offsets.append(self.offset(chunk.slot))
        return offsets

    def checksums(self, keys: Sequence[int]) -> list[int]:
        """The committed checksums of held keys (0: none given)."""
        return [self._chunks[key].checksum for key in keys]

    def unpin(self, keys: Sequence[int]) -> None:
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None and chunk.num_readers > 0:
                chunk.num_readers -= 1

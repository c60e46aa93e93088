"""The KV pool's operations as bytes: the one encoding both of its transports carry (CXL-RPC rings in shared
memory for clients on the pool's host, NATS request/reply for the rest), so both have the same semantics.

Little-endian, fixed headers then u64/i64 arrays (numpy views on decode, no per-hash Python):

    INFO     -> JSON PoolInfo                     geometry and device paths, to map the pool
    LOOKUP   u8 pin, u8 0, u16 0, u32 lease_ms, u32 n, u64 hash[n]
             -> u64 lease_id, u32 n_hit, i64 slot[n_hit], u64 checksum[n_hit], u64 generation[n_hit]
    ALLOC    u32 lease_ms, u32 n, u64 hash[n], u64 parent[n]   -> u32 n, i64 slot[n]  (NO_SLOT / NO_ROOM < 0)
    COMMIT   u32 n, u64 hash[n], u64 checksum[n]               -> u32 n, u64 generation[n]  (0: not committed)
    UNPIN    u64 lease_id                                      -> u8 ended
    FREE     u32 n, u64 hash[n]                                -> u32 freed
    STATS    -> JSON

A block's (slot, generation) names one commit: a generation is never reused, and the pool never lets a
committed slot change (services/cxlpool/block_table.py), so a reader that verified a slot's checksum at a
generation may skip that check while LOOKUP returns the same generation. COMMIT returns the generations it
issued, so the writer, which computed each checksum from the slot's bytes once it had copied them, counts
its own blocks as verified at their commit.

A request that does not parse raises `PoolRequestError`; the pool answers it with STATUS_BAD_REQUEST and goes
on serving. Arrays decode to lists through a memoryview cast and encode through `array`: for the short
arrays of most calls both are several times faster than numpy, and this codec runs on every request.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shared.errors import InvalidRequestError

MAX_HASHES = 4096  # per call: a 256K-token prompt at 64-token blocks
if sys.byteorder != "little":  # `array` packs in native order; the wire is little-endian
    raise ImportError("the pool protocol's fast encoders assume a little-endian host")
_NUMPY = {"Q": np.dtype("<u8"), "q": np.dtype("<i8")}

_LOOKUP = struct.Struct("<BBHII")
_LOOKUP_REPLY = struct.Struct("<QI")
_ALLOC = struct.Struct("<II")
_COUNT = struct.Struct("<I")
_LEASE = struct.Struct("<Q")


class Op(enum.IntEnum):
    INFO = 1
    LOOKUP = 2
    ALLOC = 3
    COMMIT = 4
    UNPIN = 5
    FREE = 6
    STATS = 7


class PoolStatus(enum.IntEnum):
    """Statuses the pool's handler answers with (the transports keep their own below 100)."""

    OK = 0
    BAD_REQUEST = 100
    UNKNOWN_OP = 101


class PoolRequestError(InvalidRequestError):
    """A pool request that does not parse or is out of range."""


@dataclass(frozen=True, slots=True)
class LookupRequest:
    hashes: list[int]
    pin: bool
    lease_ms: int


@dataclass(frozen=True, slots=True)
class LookupReply:
    lease_id: int
    slots: list[int]
    checksums: list[int]
    generations: list[int]  # each hit's commit generation (unique per commit)


def _array(data: memoryview | bytes, offset: int, n: int, code: Literal["q", "Q"], what: str) -> list[int]:
    """`n` u64 ("Q") or i64 ("q") values at `offset`, as a list."""
    end = offset + 8 * n
    if end > len(data):
        raise PoolRequestError(f"{what}: {n} entries need {end} bytes, got {len(data)}")
    return memoryview(data)[offset:end].cast(code).tolist()


def _pack(values: Sequence[int] | np.ndarray, code: str) -> bytes:
    if isinstance(values, np.ndarray):
        return values.astype(_NUMPY[code], copy=False).tobytes()
    return array(code, values).tobytes()


def _count(n: int, what: str) -> int:
    if not 0 <= n <= MAX_HASHES:
        raise PoolRequestError(f"{what}: {n} entries, at most {MAX_HASHES}")
    return n


def _exact(data: memoryview | bytes, size: int, what: str) -> None:
    if len(data) != size:
        raise PoolRequestError(f"{what}: {len(data)} bytes, expected {size}")


# ------------------------------------------------------------------------------------------- LOOKUP


def encode_lookup(hashes: Sequence[int] | np.ndarray, *, pin: bool, lease_ms: int) -> bytes:
    return _LOOKUP.pack(int(pin), 0, 0, lease_ms, len(hashes)) + _pack(hashes, "Q")


def decode_lookup(data: memoryview | bytes) -> LookupRequest:
    if len(data) < _LOOKUP.size:
        raise PoolRequestError("lookup: short header")
    pin, _, _, lease_ms, n = _LOOKUP.unpack_from(data)
    n = _count(n, "lookup")
    _exact(data, _LOOKUP.size + 8 * n, "lookup")
    return LookupRequest(_array(data, _LOOKUP.size, n, "Q", "lookup"), bool(pin), lease_ms)


def encode_lookup_reply(
    lease_id: int, slots: list[int], checksums: list[int], generations: list[int]
) -> bytes:
    # `array` packs a short list several times faster than numpy (this is the reply of every LOOKUP)
    head = _LOOKUP_REPLY.pack(lease_id, len(slots))
    return head + _pack(slots, "q") + _pack(checksums, "Q") + _pack(generations, "Q")


def decode_lookup_reply(data: memoryview | bytes) -> LookupReply:
    lease_id, n = _LOOKUP_REPLY.unpack_from(data)
    slots = _array(data, _LOOKUP_REPLY.size, n, "q", "lookup reply")
    checksums = _array(data, _LOOKUP_REPLY.size + 8 * n, n, "Q", "lookup reply")
    generations = _array(data, _LOOKUP_REPLY.size + 16 * n, n, "Q", "lookup reply")
    return LookupReply(lease_id, slots, checksums, generations)


# -------------------------------------------------------------------------------------------- ALLOC


def encode_alloc(hashes: Sequence[int], parents: Sequence[int], *, lease_ms: int) -> bytes:
    return _ALLOC.pack(lease_ms, len(hashes)) + _pack(hashes, "Q") + _pack(parents, "Q")


def decode_alloc(data: memoryview | bytes) -> tuple[list[int], list[int], int]:
    if len(data) < _ALLOC.size:
        raise PoolRequestError("alloc: short header")
    lease_ms, n = _ALLOC.unpack_from(data)
    n = _count(n, "alloc")
    _exact(data, _ALLOC.size + 16 * n, "alloc")
    hashes = _array(data, _ALLOC.size, n, "Q", "alloc")
    return hashes, _array(data, _ALLOC.size + 8 * n, n, "Q", "alloc"), lease_ms


def encode_slots(slots: list[int]) -> bytes:
    return _COUNT.pack(len(slots)) + _pack(slots, "q")


def decode_slots(data: memoryview | bytes) -> list[int]:
    (n,) = _COUNT.unpack_from(data)
    return _array(data, _COUNT.size, n, "q", "alloc reply")


# ------------------------------------------------------------------------------ COMMIT, FREE, UNPIN


def encode_commit(hashes: Sequence[int], checksums: Sequence[int]) -> bytes:
    return _COUNT.pack(len(hashes)) + _pack(hashes, "Q") + _pack(checksums, "Q")


def decode_commit(data: memoryview | bytes) -> tuple[list[int], list[int]]:
    if len(data) < _COUNT.size:
        raise PoolRequestError("commit: short header")
    n = _count(_COUNT.unpack_from(data)[0], "commit")
    _exact(data, _COUNT.size + 16 * n, "commit")
    return _array(data, _COUNT.size, n, "Q", "commit"), _array(data, _COUNT.size + 8 * n, n, "Q", "commit")


def encode_generations(generations: Sequence[int]) -> bytes:
    """COMMIT's reply: each block's commit generation, in the request's order (0: not committed)."""
    return _COUNT.pack(len(generations)) + _pack(generations, "Q")


def decode_generations(data: memoryview | bytes) -> list[int]:
    (n,) = _COUNT.unpack_from(data)
    return _array(data, _COUNT.size, n, "Q", "commit reply")


def encode_hashes(hashes: Sequence[int]) -> bytes:
    return _COUNT.pack(len(hashes)) + _pack(hashes, "Q")


def decode_hashes(data: memoryview | bytes) -> list[int]:
    if len(data) < _COUNT.size:
        raise PoolRequestError("free: short header")
    n = _count(_COUNT.unpack_from(data)[0], "free")
    _exact(data, _COUNT.size + 8 * n, "free")
    return _array(data, _COUNT.size, n, "Q", "free")


def encode_count(n: int) -> bytes:
    return _COUNT.pack(n)


def decode_count(data: memoryview | bytes) -> int:
    return int(_COUNT.unpack_from(data)[0])


def encode_lease(lease_id: int) -> bytes:
    return _LEASE.pack(lease_id)


def decode_lease(data: memoryview | bytes) -> int:
    _exact(data, _LEASE.size, "unpin")
    return int(_LEASE.unpack_from(data)[0])

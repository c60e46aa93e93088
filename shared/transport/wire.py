"""Frames of the KV data plane's control connection (pure: no I/O).

Every frame is a fixed 40-byte little-endian header, then (WRITE only) an extent table, then `meta_len`
bytes of metadata, then (WRITE only) `payload_len` bytes of payload:

    magic u16 | type u8 | flags u8 | seq u32 | region_id u32 | tag u32 | aux u32 | meta_len u32 |
    payload_len u64 | value u64

| type    | direction | aux              | meta                      | payload          | value          |
|---------|-----------|------------------|---------------------------|------------------|----------------|
| HELLO   | s -> r    | -                | TransferHello JSON        | -                | -              |
| WELCOME | r -> s    | -                | TransferWelcome JSON      | -                | -              |
| LOOKUP  | s -> r    | -                | region name (UTF-8)       | -                | -              |
| REGION  | r -> s    | -                | RegionInfo JSON           | -                | -              |
| WRITE   | s -> r    | number of extents| notice meta (if NOTICE)   | extents' bytes   | -              |
| NOTICE  | s -> r    | rdma immediate   | notice meta               | -                | bytes written  |
| ACK     | r -> s    | -                | -                         | -                | -              |
| ERROR   | r -> s    | -                | ErrorReply JSON           | -                | -              |
| BYE     | s <-> r   | -                | -                         | -                | -              |

A WRITE's extent table is `aux` pairs of u64 (offset, length) in region `region_id`; the payload is the
extents' bytes concatenated in table order. Flag NOTICE on a WRITE or NOTICE frame posts notice
(`region_id`, `tag`, meta) once the bytes are in place; flag IMM on a NOTICE says the bytes came over RDMA
and the notice must wait for the RDMA write-with-immediate whose immediate is `aux`. Every frame the
sender numbers with `seq` is answered by exactly one ACK, ERROR, WELCOME or REGION with the same `seq`.
BYE (unnumbered, unanswered) says the side that sends it is closing the connection on purpose.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

from shared.errors import TransportError

MAGIC = 0x4B56  # "VK" little-endian: the bytes b"VK" on the wire
HEADER = struct.Struct("<HBBIIIIIQQ")
HEADER_BYTES = HEADER.size
EXTENT_BYTES = 16
U32_MAX = 0xFFFFFFFF
EXTENT_DTYPE = np.dtype("<u8")
_ONE_EXTENT = struct.Struct("<QQ")
_SMALL_TABLE = 32


class FrameType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    LOOKUP = 3
    REGION = 4
    WRITE = 5
    NOTICE = 6
    ACK = 7
    ERROR = 8
    BYE = 9


class Flag(enum.IntFlag):
    NONE = 0
    NOTICE = 1  # post a notice after the bytes are in place
    IMM = 2  # NOTICE frame: join with the RDMA immediate `aux`


# enum construction and arithmetic are slow; headers are parsed on the hot path
_TYPES = {int(t): t for t in FrameType}
_FLAGS = {int(f): f for f in (Flag(v) for v in range(4))}
_NOTICE, IMM = int(Flag.NOTICE), int(Flag.IMM)

SENDER_TYPES = frozenset(
    {FrameType.HELLO, FrameType.LOOKUP, FrameType.WRITE, FrameType.NOTICE, FrameType.BYE}
)
RECEIVER_TYPES = frozenset(
    {FrameType.WELCOME, FrameType.REGION, FrameType.ACK, FrameType.ERROR, FrameType.BYE}  # BYE: it stops
)


class FrameError(TransportError):
    """A frame that breaks the format; the connection that sent it is closed."""


@dataclass(slots=True)  # not frozen: frozen slotted init is ~5x slower, and headers are per frame
class Header:
    type: FrameType
    flags: Flag = Flag.NONE
    seq: int = 0
    region_id: int = 0
    tag: int = 0
    aux: int = 0
    meta_len: int = 0
    payload_len: int = 0
    value: int = 0

    @property
    def table_len(self) -> int:
        """Bytes of extent table between the header and the meta."""
        return self.aux * EXTENT_BYTES if self.type is FrameType.WRITE else 0

    @property
    def has_notice(self) -> bool:
        return bool(int(self.flags) & _NOTICE)  # int first: IntFlag's own `&` runs in Python, per frame


@dataclass(slots=True, frozen=True)
class Limits:
    """Bounds a reader enforces; anything beyond is a malformed frame."""

    max_meta_bytes: int = 1 << 16
    max_extents: int = 1 << 16
    max_payload_bytes: int = 1 << 40


def pack(header: Header) -> bytes:
    return HEADER.pack(
        MAGIC,
        header.type,
        header.flags,
        header.seq,
        header.region_id,
        header.tag,
        header.aux,
        header.meta_len,
        header.payload_len,
        header.value,
    )


def pack_fields(
    frame_type: int,
    flags: int,
    seq: int,
    region_id: int,
    tag: int,
    aux: int,
    meta_len: int,
    payload_len: int,
    value: int,
) -> bytes:
    """`pack` without building a Header first (the per-op frames of the data plane)."""
    return HEADER.pack(MAGIC, frame_type, flags, seq, region_id, tag, aux, meta_len, payload_len, value)


def unpack(data: bytes | bytearray | memoryview, limits: Limits, allowed: frozenset[FrameType]) -> Header:
    """Parse and check one header; raise FrameError naming what is wrong."""
    magic, ftype, flags, seq, region_id, tag, aux, meta_len, payload_len, value = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic 0x{magic:04x}")
    frame_type = _TYPES.get(ftype)
    if frame_type is None:
        raise FrameError(f"unknown frame type {ftype}")
    if frame_type not in allowed:
        raise FrameError(f"frame type {frame_type.name} not expected in this direction")
    flag = _FLAGS.get(flags)
    if flag is None:
        raise FrameError(f"unknown frame flags 0x{flags:02x}")
    if meta_len > limits.max_meta_bytes:
        raise FrameError(f"frame meta of {meta_len} bytes exceeds {limits.max_meta_bytes}")
    if frame_type is FrameType.WRITE:
        if aux > limits.max_extents:
            raise FrameError(f"write of {aux} extents exceeds {limits.max_extents}")
        if payload_len > limits.max_payload_bytes:
            raise FrameError(f"write of {payload_len} bytes exceeds {limits.max_payload_bytes}")
    elif payload_len:
        raise FrameError(f"{frame_type.name} frame may not carry a payload")
    return Header(frame_type, flag, seq, region_id, tag, aux, meta_len, payload_len, value)


def pack_extents(offsets: list[int], lengths: list[int]) -> bytes:
    if len(offsets) == 1:  # the common Layer-Block write: struct is ~5x cheaper than an array here
        return _ONE_EXTENT.pack(offsets[0], lengths[0])
    table = np.empty((len(offsets), 2), dtype=EXTENT_DTYPE)
    table[:, 0] = offsets
    table[:, 1] = lengths
    return table.tobytes()


def unpack_extents(data: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """The extent table as a `[count, 2]` array of (offset, length)."""
    return np.frombuffer(data, dtype=EXTENT_DTYPE, count=count * 2).reshape(count, 2)


def extents_in_bounds(table: np.ndarray, size_bytes: int) -> bool:
    """Every extent lies inside [0, size_bytes) (no overflow: compare length with the room left)."""
    if len(table) <= _SMALL_TABLE:  # numpy's per-call overhead dominates small tables
        return all(o <= size_bytes and n <= size_bytes - o for o, n in table.tolist())
    offsets, lengths = table[:, 0], table[:, 1]
    room = size_bytes - np.minimum(offsets, size_bytes)
    return bool(np.all(offsets <= size_bytes) and np.all(lengths <= room))


def payload_bytes(table: np.ndarray) -> int:
    """Sum of the extents' lengths."""
    if len(table) <= _SMALL_TABLE:
        return sum(n for _, n in table.tolist())
    return int(table[:, 1].sum(dtype=np.uint64))


def check_tag(tag: int) -> int:
    if not 0 <= tag <= U32_MAX:
        raise TransportError(f"notice tag {tag} is not a u32", param="tag")
    return tag

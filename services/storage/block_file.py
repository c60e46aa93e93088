"""The on-disk format of one Full Block file and the low-level I/O on it.

A file is a 64-byte header then the payload, all little-endian:

    magic "KVPBLK01" | version u16 | header bytes u16 | writer node u32 | fingerprint hash u64 |
    block hash u64 | parent hash u64 | payload bytes u64 | payload xxh3_64 u64 | header xxh3_64 u64

Reads fill caller-provided buffers with preadv (no intermediate copy), hashing cache-sized chunks as they
land; writes gather header and payload with writev.
"""

from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

MAGIC = b"KVPBLK01"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHIQQQQQQ")
HEADER_BYTES = _HEADER.size  # 64
_READ_CHUNK_BYTES = 256 * 1024  # fits in L2: each chunk is hashed while still cached


class ReadOutcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"
    FOREIGN = "foreign"


@dataclass(slots=True, frozen=True)
class BlockHeader:
    writer_node: int
    fingerprint_hash: int
    block_hash: int
    parent_hash: int
    payload_bytes: int
    payload_checksum: int

    def pack(self) -> bytes:
        fields = (
            MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            self.writer_node,
            self.fingerprint_hash,
            self.block_hash,
            self.parent_hash,
            self.payload_bytes,
            self.payload_checksum,
        )
        head_sum = xxhash.xxh3_64_intdigest(_HEADER.pack(*fields, 0)[: HEADER_BYTES - 8])
        return _HEADER.pack(*fields, head_sum)

    @classmethod
    def unpack(cls, raw: bytes | bytearray | memoryview) -> BlockHeader | None:
        """The header, or None when it is not a valid kvpath block header."""
        if len(raw) < HEADER_BYTES:
            return None
        fields = _HEADER.unpack_from(raw)
        magic, version, header_bytes, node, fp, block, parent, length, checksum, head_sum = fields
        if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
            return None
        if xxhash.xxh3_64_intdigest(bytes(raw[: HEADER_BYTES - 8])) != head_sum:
            return None
        return cls(node, fp, block, parent, length, checksum)


def check(
    head: bytearray,
    got: int,
    trailing: int,
    fingerprint_hash: int,
    block_hash: int,
    payload_bytes: int,
    checksum: int | None,
) -> ReadOutcome:
    """Classify what a read returned: `got` bytes, `trailing` bytes beyond the expected end."""
    header = BlockHeader.unpack(head) if got >= HEADER_BYTES else None
    if header is None:
        return ReadOutcome.CORRUPT
    if header.fingerprint_hash != fingerprint_hash:
        return ReadOutcome.FOREIGN
    if header.block_hash != block_hash or header.payload_bytes != payload_bytes:
        return ReadOutcome.CORRUPT
    if got != HEADER_BYTES + payload_bytes or trailing != 0:
        return ReadOutcome.CORRUPT
    if checksum is not None and checksum != header.payload_checksum:
        return ReadOutcome.CORRUPT
    return ReadOutcome.OK


def writer_node(path: str) -> int | None:
    """The writer node named in a file's header (None if unreadable)."""
    try:
        with open(path, "rb") as f:
            header = BlockHeader.unpack(f.read(HEADER_BYTES))
    except OSError:
        return None
    return None if header is None else header.writer_node


def read_hashed(fd: int, head: bytearray, dest: memoryview, hasher: Any) -> int:
    """Read header + payload into (head, dest) in cache-sized chunks, hashing each chunk as it lands.

    Returns the bytes read (less than header + payload at end of file).
    """
    dest = dest.cast("B") if dest.format != "B" else dest
    first = min(_READ_CHUNK_BYTES, len(dest))
    got = _preadv_full(fd, [memoryview(head), dest[:first]], 0)
    if got < HEADER_BYTES + first:
        return got
    if hasher is not None:
        hasher.update(dest[:first])
    offset = first
    while offset < len(dest):
        end = min(offset + _READ_CHUNK_BYTES, len(dest))
        n = _preadv_full(fd, [dest[offset:end]], HEADER_BYTES + offset)
        got += n
        if n < end - offset:
            return got
        if hasher is not None:
            hasher.update(dest[offset:end])
        offset = end
    return got


def _preadv_full(fd: int, views: list[memoryview], file_offset: int) -> int:
    """preadv into `views` from `file_offset` until they are full or the file ends; return bytes read."""
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        n = os.preadv(fd, _skip(views, done), file_offset + done)
        if n == 0:
            break
        done += n
    return done


def writev_full(fd: int, buffers: list[memoryview]) -> None:
    views = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        done += os.writev(fd, _skip(views, done))


def _skip(views: list[memoryview], offset: int) -> list[memoryview]:
    """The iovec list past the first `offset` bytes."""
    out = []
    for v in views:
        if offset >= v.nbytes:
            offset -= v.nbytes
            continue
        out.append(v[offset:] if offset else v)
        offset = 0
    return out


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

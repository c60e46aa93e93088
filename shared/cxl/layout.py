"""Byte layout of a CXL-RPC segment: where every header field, client entry, descriptor and payload lives.

The segment is one file in /dev/shm that the server creates and every client maps (MAP_SHARED). All offsets
are from the start of the file; every line below is 64 bytes and 64-byte aligned, and each line has exactly
one writer (noted per line) so no two processes store into the same cache line on the hot path. The one
exception, the doorbell line, is written only around the server's sleeps.

    offset                      what                                          written by
    0                           header line 0                                 server
      +0  u64 magic ("KVCXLRPC")   +8  u32 layout version
      +12 u32 num_clients          +16 u32 queue_depth     +20 u32 payload_bytes
      +24 u64 server epoch (time.time_ns() at creation; a restarted server has a new file and a new epoch)
      +32 u64 server heartbeat (CLOCK_MONOTONIC ns; time.monotonic_ns() is system-wide on Linux)
      +40 u32 server pid
    64                          header line 1: the doorbell
      +0  u32 server sleeping flag                                             server
      +4  u32 doorbell futex word (bumped by a client that finds the server asleep)   clients
    128 + 128*c                 client entry c, line A                        client c
      +0  u64 client epoch (0: free; a claim writes it last, a clean close zeroes it)
      +8  u64 client heartbeat (monotonic ns of the claim and of every slow wait; informational)
      +16 u32 pid    +20 u32 waiting (how many of the client's threads sleep on its reply word)
    128 + 128*c + 64            client entry c, line B                        server
      +0  u64 adopted epoch (the client epoch the server serves on this entry; 0: none)
      +8  u32 reply futex word (bumped after a poll sweep's replies, when the client has a thread asleep)
    slots_offset + c*client_stride      client c's block:
      request descriptors  [queue_depth] x 64 B                               client c
        +0 u64 seq (stored last)   +8 u32 op   +12 u32 payload length
      response descriptors [queue_depth] x 64 B                               server
        +0 u64 seq (stored last; == the request's seq when the reply is ready)
        +8 u32 status   +12 u32 payload length
      request payloads     [queue_depth] x payload_bytes                      client c
      response payloads    [queue_depth] x payload_bytes                      server

Liveness does not live in the bytes: the server holds an OFD lock on byte 0 of the file and client c on
byte 1 + c (see `segment.py`); the kernel drops a lock when its process dies.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

MAGIC = int.from_bytes(b"KVCXLRPC", "little")
LAYOUT_VERSION = 1
CACHE_LINE_BYTES = 64
MAX_OP = 0xFFFF  # ops travel as u32, but anything above this is a garbage descriptor

# Fields that another process reads while they change (sequence numbers, epochs, the heartbeat, futex words
# and flags) are loaded and stored through memoryview casts of the mapping ('Q', 'I'; `RpcSegment.u64/u32`):
# CPython moves a memoryview item with one memcpy of its size, a single aligned mov, atomic on x86-64.
# struct.pack_into must not write them: it zeroes its target before packing, so a reader racing it can see 0
# (a sequence number that never was). It is fine for fields published by a later sequence-number store.
BODY = struct.Struct("II")  # request: op, length; response: status, length (at descriptor + 8)
HEADER = struct.Struct("QIIIIQQI")  # magic .. server pid

# header fields
EPOCH_OFFSET = 24
HEARTBEAT_OFFSET = 32
SLEEPING_OFFSET = 64
DOORBELL_OFFSET = 68
CLIENT_TABLE_OFFSET = 128
CLIENT_ENTRY_BYTES = 128
# client entry fields, from the entry's start
CLIENT_EPOCH = 0
CLIENT_HEARTBEAT = 8
CLIENT_PID = 16
CLIENT_WAITING = 20
ADOPTED_EPOCH = 64
REPLY_WORD = 72

SERVER_LOCK_BYTE = 0


def client_lock_byte(client_id: int) -> int:
    return 1 + client_id


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True, slots=True)
class Layout:
    """Geometry of one segment; every offset the two sides agree on is computed here."""

    num_clients: int
    queue_depth: int
    payload_bytes: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_clients <= 4096:
            raise ValueError(f"num_clients must be in 1..4096, got {self.num_clients}")
        if not 1 <= self.queue_depth <= 1024:
            raise ValueError(f"queue_depth must be in 1..1024, got {self.queue_depth}")
        if not 0 < self.payload_bytes < 1 << 31 or self.payload_bytes % CACHE_LINE_BYTES:
            raise ValueError(f"payload_bytes must be a positive multiple of 64, got {self.payload_bytes}")

    @property
    def slots_offset(self) -> int:
        return _align(CLIENT_TABLE_OFFSET + self.num_clients * CLIENT_ENTRY_BYTES, 4096)

    @property
    def client_stride(self) -> int:
        return 2 * self.queue_depth * (CACHE_LINE_BYTES + self.payload_bytes)

    @property
    def size_bytes(self) -> int:
        return self.slots_offset + self.num_clients * self.client_stride

    def client_entry(self, client_id: int) -> int:
        return CLIENT_TABLE_OFFSET + client_id * CLIENT_ENTRY_BYTES

    def request_descriptor(self, client_id: int, slot: int) -> int:
        return self.slots_offset + client_id * self.client_stride + slot * CACHE_LINE_BYTES

    def response_descriptor(self, client_id: int, slot: int) -> int:
        return self.request_descriptor(client_id, slot) + self.queue_depth * CACHE_LINE_BYTES

    def request_payload(self, client_id: int, slot: int) -> int:
        block = self.slots_offset + client_id * self.client_stride
        return block + 2 * self.queue_depth * CACHE_LINE_BYTES + slot * self.payload_bytes

    def response_payload(self, client_id: int, slot: int) -> int:
        return self.request_payload(client_id, slot) + self.queue_depth * self.payload_bytes

    def pack_header(self, epoch: int, heartbeat_ns: int, pid: int) -> bytes:
        return HEADER.pack(
            MAGIC,
            LAYOUT_VERSION,
            self.num_clients,
            self.queue_depth,
            self.payload_bytes,
            epoch,
            heartbeat_ns,
            pid,
        )

    @classmethod
    def from_header(cls, header: bytes | memoryview | mmap.mmap, size_bytes: int) -> Layout:
        """The layout a server wrote, checked against the file's size (a client trusts nothing else)."""
        magic, version, num_clients, queue_depth, payload_bytes, *_ = HEADER.unpack_from(header, 0)
        if magic != MAGIC or version != LAYOUT_VERSION:
            raise ValueError(
                f"not a CXL-RPC segment of layout {LAYOUT_VERSION} (magic {magic:#x}, v{version})"
            )
        layout = cls(num_clients, queue_depth, payload_bytes)
        if layout.size_bytes != size_bytes:
            raise ValueError(f"segment is {size_bytes} bytes, its header describes {layout.size_bytes}")
        return layout

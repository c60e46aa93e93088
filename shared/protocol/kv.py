"""KV messages: KV events (JetStream), the metadata index API and the storage service API.

Block hashes travel as unsigned 64-bit JSON integers (`shared.hashing`). Locations are strings
`<tier>` or `<tier>:<id>`: `store` (persistent storage, readable by every storage service over the
shared root), later `hbm:<engine>`, `dram:<node>`, `cxl:<pool>`; a new tier needs no format change.
KV bytes never travel here: reads name (buffer, offset) in the node buffer, writes name (segment, offsets)
in the engine's staging segment.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from shared.protocol.codec import U64_MAX, Message, message

TIER_STORE = "store"
TIERS = ("hbm", "dram", "cxl", "store", "held")  # held: chunks an engine pins for routed queries


def check_location(location: str) -> None:
    """ValueError unless `location` is `<tier>` or `<tier>:<id>` of a known tier and a plain id."""
    tier, colon, ident = location.partition(":")
    if tier not in TIERS or (colon and not ident.replace("-", "").replace("_", "").isalnum()):
        raise ValueError(f"location {location!r} is not <tier>[:<id>] with a tier of {', '.join(TIERS)}")


def location_tier(location: str) -> str:
    """`hbm:engine-1` -> `hbm`; `store` -> `store`."""
    return location.split(":", 1)[0]


# ----------------------------------------------------------------------------------------- KV events


@dataclasses.dataclass(slots=True, kw_only=True)
class KvEvent(Message):
    """Base of the KV events on `kv.events.<source>`.

    `(epoch, seq)` orders one source's events: `seq` counts from 1 within an epoch, and a source that
    restarts starts a new, larger epoch (its start time in ns). Consumers apply an event only when its
    (epoch, seq) is newer than the last one applied for that source, which makes duplicates and replays
    no-ops.
    """

    source: str
    epoch: int
    seq: int
    sent_at: float = 0.0


@message
class BlockStored(KvEvent):
    """Blocks became readable at `location`; `parent_hashes[i]` is block i's parent (chain structure)."""

    KIND = "kv_block_stored"
    RANGES = {"block_hashes": (0, U64_MAX), "parent_hashes": (0, U64_MAX), "block_tokens": (0, 1 << 20)}
    location: str
    block_hashes: list[int]
    parent_hashes: list[int] = field(default_factory=list)
    block_tokens: int = 0

    def check(self) -> None:
        check_location(self.location)
        if self.parent_hashes and len(self.parent_hashes) != len(self.block_hashes):
            raise ValueError(
                f"{len(self.parent_hashes)} parent hashes for {len(self.block_hashes)} blocks (0 or one each)"
            )


@message
class BlockRemoved(KvEvent):
    KIND = "kv_block_removed"
    RANGES = {"block_hashes": (0, U64_MAX)}
    location: str
    block_hashes: list[int]
    reason: str = ""  # evicted | corrupt | missing | released

    def check(self) -> None:
        check_location(self.location)


@message
class Cleared(KvEvent):
    """Every block at these locations is gone (a wiped store, an engine restart)."""

    KIND = "kv_cleared"
    locations: list[str]
    reason: str = ""


KV_EVENT_TYPES: tuple[type[KvEvent], ...] = (BlockStored, BlockRemoved, Cleared)


# ---------------------------------------------------------------------------------------------- index


@message
class IndexMatchRequest(Message):
    """`index.match`: the block hashes of a prompt, in chain order."""

    KIND = "index_match"
    block_hashes: list[int]


@message
class IndexMatchReply(Message):
    """Hit counts, each the number of consecutive hashes from the start present there."""

    KIND = "index_match_reply"
    num_hit_blocks: int  # consecutive from the start, present in any location
    per_tier: dict[str, int] = field(default_factory=dict)
    per_location: dict[str, int] = field(default_factory=dict)


@message
class IndexStatsRequest(Message):
    KIND = "index_stats_request"


@message
class IndexStats(Message):
    KIND = "index_stats"
    service_id: str
    num_blocks: int
    table_bytes: int
    applied_stream_seq: int  # last stream sequence applied (0: none)
    snapshot_stream_seq: int = 0
    num_events_applied: int = 0
    num_events_ignored: int = 0
    locations: list[str] = field(default_factory=list)


# -------------------------------------------------------------------------------------------- storage


@message
class StorageInfoRequest(Message):
    KIND = "storage_info_request"


@message
class StorageInfo(Message):
    """What an engine needs to map its node's buffer; `buffer_epoch` changes when the segment is recreated."""

    KIND = "storage_info"
    service_id: str
    node: int
    buffer_name: str
    buffer_bytes: int
    buffer_epoch: int


@message
class StorageReadRequest(Message):
    """`storage.<node>.read`: read these Full Blocks into the node buffer and lease them to `request_id`."""

    KIND = "storage_read"
    request_id: str
    fingerprint: str
    block_hashes: list[int]
    block_bytes: int
    block_tokens: int = 0  # tokens per block, for the read queue in load reports
    timeout_s: float = 30.0  # the service gives up (and frees the space) after this long
    lease_s: float = 0.0  # how long the lease lives without a release; 0: the service default


@message
class StorageReadReply(Message):
    """The first `num_blocks` requested blocks, verified, at `offset` of the node buffer.

    `num_blocks` < requested when a block is missing or corrupt (`miss_reason`); 0 blocks: no lease.
    """

    KIND = "storage_read_reply"
    request_id: str
    lease_id: str
    buffer_name: str
    buffer_epoch: int
    offset: int
    num_blocks: int
    block_bytes: int
    lease_deadline_unix_s: float = 0.0
    miss_reason: str = ""  # "" | missing | corrupt | foreign | buffer_limit


@message
class StorageWriteRequest(Message):
    """`storage.<node>.write`: persist blocks the engine staged in its shared-memory segment."""

    KIND = "storage_write"
    request_id: str
    fingerprint: str
    segment_name: str
    offsets: list[int]  # byte offset of each block in the segment
    block_bytes: int
    block_hashes: list[int]
    parent_hashes: list[int]
    block_tokens: int = 0
    timeout_s: float = 30.0


@message
class StorageWriteReply(Message):
    """Every block is durable (`fsync_policy`) and announced; `event_stream_seq` is its BlockStored event."""

    KIND = "storage_write_reply"
    request_id: str
    num_written: int
    num_existing: int
    event_stream_seq: int = 0  # 0: nothing announced (all existed, or the event stream was unavailable)


@message
class StorageRelease(Message):
    """Control: the engine is done with a lease (idempotent)."""

    KIND = "storage_release"
    lease_id: str


@message
class StorageCancel(Message):
    """Control: stop the reads of `request_id` and release its leases (the client will not use them)."""

    KIND = "storage_cancel"
    request_id: str


STORAGE_CONTROL_TYPES: tuple[type[Message], ...] = (StorageInfoRequest, StorageRelease, StorageCancel)


# ----------------------------------------------------------------------------------------- KV pool


@message
class PoolInfo(Message):
    """What a client needs to use a KV pool (`cxl:<pool_id>`): its KV format, its slot geometry, the
    devices to map and the CXL-RPC segment to attach. `epoch` changes when the pool restarts (its contents
    are then gone). `host_id` says where the emulated devices are (`shared.transport` host ids): a client on
    another host reaches the pool's operations over NATS and maps the devices only if it can open them."""

    KIND = "pool_info"
    pool_id: str
    epoch: int
    fingerprint: str
    block_size: int
    slot_bytes: int
    num_slots: int
    num_devices: int
    interleave_bytes: int
    device_paths: list[str]
    rpc_segment: str = ""
    host_id: str = ""


# ------------------------------------------------------------------------- remote KV store (baseline)
# The remote-memory pool Beluga is measured against (vLLM + LMCache + Mooncake store): super blocks of
# `chunk_tokens` tokens, each keyed by the chained hash of its LAST block (which names the whole prefix),
# held in a store's DRAM region. Metadata travels here (`remotekv.<store>.<op>`); bytes move one-sidedly on
# the KV data plane: engines write into the store's region after a PUT, the store writes into an engine's
# region for a GET.

REMOTEKV_PUT_OUTCOMES = ("ok", "exists", "full")  # ok: reserved at the offset; exists: held or being written


@message
class RemoteKvInfoRequest(Message):
    KIND = "remotekv_info_request"


@message
class RemoteKvInfo(Message):
    """What an engine needs to use a remote KV store: the region it writes super blocks into, the store's
    receiver (`KvEndpoint`), the super-block geometry. `epoch` changes when the store restarts (its contents
    and offsets are then gone). `chunk_bytes` is the adopted super-block size (0: nothing adopted yet)."""

    KIND = "remotekv_info"
    store_id: str
    epoch: int
    region: str
    endpoint: dict[str, Any]
    chunk_tokens: int
    capacity_bytes: int
    chunk_bytes: int = 0
    fingerprint: str = ""
    used_bytes: int = 0
    num_chunks: int = 0


@message
class RemoteKvPut(Message):
    """`remotekv.<store>.put`: reserve slots for these super blocks. The writer then writes each reserved one
    at its offset and COMMITs; slots not committed within `timeout_s` go back to the store."""

    KIND = "remotekv_put"
    request_id: str
    fingerprint: str
    chunk_tokens: int
    chunk_bytes: int
    keys: list[int]
    timeout_s: float = 10.0


@message
class RemoteKvPutReply(Message):
    """Per key: `offsets[i]` in the store's region (-1 unless reserved) and `outcomes[i]` (ok | exists |
    full). `put_id` names the reservation in the COMMIT (0: nothing reserved)."""

    KIND = "remotekv_put_reply"
    epoch: int
    put_id: int
    offsets: list[int]
    outcomes: list[str]


@message
class RemoteKvCommit(Message):
    """`remotekv.<store>.commit`: the super blocks `keys` of reservation `put_id` are written, publish them;
    the reservation's other keys are given back (their write failed or was skipped)."""

    KIND = "remotekv_commit"
    put_id: int
    keys: list[int]
    checksums: list[int] = field(default_factory=list)  # per key: xxh3-64 of its bytes ([]: none given)


@message
class RemoteKvCommitReply(Message):
    KIND = "remotekv_commit_reply"
    num_committed: int
    num_released: int = 0


@message
class RemoteKvTarget(Message):
    """Where a store writes the super blocks of a GET: an engine's registered transport region, one byte
    offset per requested key."""

    KIND = "remotekv_target"
    engine_id: str
    endpoint: dict[str, Any]  # the engine's KvEndpoint (shared.transport)
    region: str
    offsets: list[int]


@message
class RemoteKvGet(Message):
    """`remotekv.<store>.get`: write the longest prefix of `keys` the store holds (committed) into
    `target`; the reply comes once those bytes are there."""

    KIND = "remotekv_get"
    request_id: str
    fingerprint: str
    chunk_tokens: int
    chunk_bytes: int
    keys: list[int]
    target: RemoteKvTarget
    timeout_s: float = 5.0


@message
class RemoteKvGetReply(Message):
    """`num_hit_chunks` leading keys are in the target region; `miss_reason` says why the next one is not
    ("" | missing | foreign: the store holds another KV format). `exists`: which keys the store holds;
    `checksums`: the hits' checksums as their writer committed them, for the reader to verify."""

    KIND = "remotekv_get_reply"
    epoch: int
    num_hit_chunks: int
    miss_reason: str = ""
    exists: list[bool] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)  # per hit: its COMMIT checksum (0: none given)


@message
class RemoteKvExist(Message):
    """`remotekv.<store>.exist`: which of these super blocks the store holds (committed)."""

    KIND = "remotekv_exist"
    keys: list[int]


@message
class RemoteKvExistReply(Message):
    KIND = "remotekv_exist_reply"
    epoch: int
    exists: list[bool]
    num_prefix_chunks: int  # leading keys held

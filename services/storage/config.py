"""Storage service configuration."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import BaseConfig, check, doc

FSYNC_POLICIES = ("none", "file", "dir")


@dataclass(slots=True)
class StorageConfig(BaseConfig):
    root: str = doc("./kvstore", "directory holding Full Block files (a local dir or a distributed FS mount)")
    is_shared_root: bool = doc(
        False, "root is shared by several nodes: adopt only own files on start, LRU by file mtime"
    )
    buffer_bytes: int = doc(256 * 1024 * 1024, "size of the node DRAM buffer (shared memory) reads land in")
    buffer_name: str = doc(
        "", "shared-memory name of the node buffer; default kvpath-<namespace>-node<N>-buf"
    )
    bandwidth_bytes_per_s: float = doc(0.0, "read budget of the node's storage NIC in bytes/s; 0: unlimited")
    write_bandwidth_bytes_per_s: float = doc(0.0, "write budget (the NIC's other direction); 0: unlimited")
    burst_bytes: int = doc(0, "bytes the token buckets may send at once after an idle period")
    capacity_bytes: int = doc(
        0, "bytes of block files this node may keep (LRU eviction beyond); 0: what the file system holds"
    )
    min_free_bytes: int = doc(
        -1, "with capacity_bytes 0: free space kept on the file system (LRU eviction); -1: 5%, at most 1 GiB"
    )
    fsync_policy: str = doc(
        "file", "durability before a write is acknowledged: none | file (fsync data) | dir (and directory)"
    )
    verify_checksums: bool = doc(True, "check every block's payload checksum on read")
    max_concurrent_reads: int = doc(8, "block reads in flight at once (I/O threads)")
    max_concurrent_writes: int = doc(4, "block writes in flight at once (I/O threads)")
    max_pending_reads: int = doc(256, "read requests queued or running; more are refused (overloaded)")
    max_pending_writes: int = doc(64, "write requests queued or running; more are refused (overloaded)")
    max_blocks_per_request: int = doc(16384, "most blocks one read or write request may name")
    lease_s: float = doc(30.0, "a read lease not released within this long is reclaimed")
    max_lease_s: float = doc(600.0, "longest lease a reader may ask for")
    max_attached_segments: int = doc(64, "engine staging segments kept mapped for writes")
    announce_on_start: bool = doc(False, "publish BlockStored for every block found on start (index rebuild)")

    def validate(self) -> None:
        BaseConfig.validate(self)
        check(bool(self.root), "root", self.root, "must name a directory")
        check(self.buffer_bytes >= 4096, "buffer_bytes", self.buffer_bytes, "must be >= 4096")
        for name in ("bandwidth_bytes_per_s", "write_bandwidth_bytes_per_s", "burst_bytes", "capacity_bytes"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0 (0: unlimited)")
        check(self.fsync_policy in FSYNC_POLICIES, "fsync_policy", self.fsync_policy, "none, file or dir")
        for name in (
            "max_concurrent_reads",
            "max_concurrent_writes",
            "max_pending_reads",
            "max_pending_writes",
            "max_blocks_per_request",
            "max_attached_segments",
        ):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(self.lease_s > 0, "lease_s", self.lease_s, "must be > 0")
        check(self.max_lease_s >= self.lease_s, "max_lease_s", self.max_lease_s, f">= lease_s={self.lease_s}")

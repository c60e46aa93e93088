"""KV pool service configuration."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import DEFAULT_BLOCK_SIZE, BaseConfig, check, doc
from shared.cxl.pool_memory import DEFAULT_INTERLEAVE_BYTES


@dataclass(slots=True)
class PoolConfig(BaseConfig):
    pool_id: str = doc("", "the pool's name (KV location cxl:<pool_id>); default: the service id")
    model: str = doc("tiny", "model whose KV the pool holds (slot size = one Full Block of it)")
    model_cache_dir: str = doc("", "where embedded models are materialized (default ~/.cache/kvpath/models)")
    dtype: str = doc(
        "",
        "KV dtype of the engines that use the pool (their KV format must match); default: the engines'"
        " default on this host, bfloat16 where CUDA is available, else float32",
    )
    block_size: int = doc(DEFAULT_BLOCK_SIZE, "KV block size in tokens (the engines')")
    capacity_bytes: int = doc(1 << 30, "pool memory in bytes (rounded down to whole slots)")
    num_devices: int = doc(4, "memory devices the pool stripes over (emulated: one /dev/shm file each)")
    interleave_bytes: int = doc(DEFAULT_INTERLEAVE_BYTES, "software interleave granularity across devices")
    device_paths: list[str] = doc(  # noqa: RUF009
        [], "DAX devices or hugetlbfs files to map, one per device (default: /dev/shm)"
    )
    lease_ms: int = doc(30_000, "read lease (and write allocation) lifetime when a client names none")
    rpc_clients: int = doc(64, "CXL-RPC client entries (processes attached at once)")
    rpc_queue_depth: int = doc(8, "CXL-RPC calls in flight per client")
    rpc_payload_bytes: int = doc(
        98368, "CXL-RPC bytes per request/reply slot (the reply of a LOOKUP of 4096 blocks: 12 + 24 x 4096)"
    )
    expire_interval_s: float = doc(0.5, "how often expired leases and allocations are reclaimed")

    def validate(self) -> None:
        BaseConfig.validate(self)
        check(self.capacity_bytes > 0, "capacity_bytes", self.capacity_bytes, "must be > 0")
        check(self.num_devices >= 1, "num_devices", self.num_devices, "must be >= 1")
        check(
            not self.device_paths or len(self.device_paths) == self.num_devices,
            "device_paths",
            self.device_paths,
            f"one path per device ({self.num_devices})",
        )
        check(self.lease_ms > 0, "lease_ms", self.lease_ms, "must be > 0")
        check(
            self.rpc_payload_bytes % 64 == 0, "rpc_payload_bytes", self.rpc_payload_bytes, "a multiple of 64"
        )

"""Cost terms of the two shared KV tiers at the paper's scale, pure (no clock, no links).

Beluga (brief 1.6, 3, 4.3, 7.4): one copy kernel per request moves every block of its load or store (O5), so
the launch/sync is paid once; each 16-token block is 2 x layers non-contiguous chunks with a small per-chunk
cost; the metadata goes over CXL-RPC. The bytes then cross the socket's PCIe/CXL adapter and the memory
devices (`paths.py` puts them on fluid links).

The MoonCake-like baseline (brief 1.3, 1.4, 4.3, 5.6): CPU-driven, per 256-token super block object (LMCache's
chunk; only whole objects are stored or hit). A load, object by object: an RDMA metadata RPC, the object's 128
chunks posted as work requests of at most 30 SGEs, a copy kernel between the host bounce buffer and HBM and
its sync, then NIC and PCIe bytes. The paper blames the rest of its gap on "extra memory copies and
allocations" in the critical path (7.1) without numbers, so those two are calibrated (I): a per-object
overhead and a per-byte extra host copy of the retrieve. They are fitted to two of the paper's numbers, the
baseline's cache-hit TTFT with 256-token objects (13.0 s) and with 16-token ones (76.8 s, Exp #8); every
other baseline number the sweep prints is a prediction. A store holds the step only for its copy kernels: the
put to the pool runs in the background.

Tags: (P) the paper's number, (I) inferred or calibrated here; section numbers are the brief's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


def whole_units(tokens: int, unit_tokens: int) -> int:
    """Whole units (blocks, super blocks) in `tokens`: only full ones are stored or hit."""
    return tokens // unit_tokens


def hit_cap_tokens(prompt_tokens: int, unit_tokens: int) -> int:
    """Most prompt tokens a tier serves: whole units before the last prompt token (vLLM computes that one)."""
    return whole_units(max(0, prompt_tokens - 1), unit_tokens) * unit_tokens


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Qwen-32B's KV layout: one token is 2 x layers x KV heads x head dim values."""

    num_layers: int = 64  # (P) "64 layers x 2 for key/value" (4.2)
    num_kv_heads: int = 8  # (P) GQA, n_heads = 8 (4.2)
    head_dim: int = 128  # (I) public Qwen3-32B config; the paper's 20 KB chunks imply 80 (brief 4.2, 9.2)
    dtype_bytes: int = 2  # (I) bf16 KV (unquantized model, 6.1)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def chunks_per_block(self) -> int:
        """Non-contiguous chunks of one block in paged HBM: one K and one V per layer (P: 128), whatever the
        block's token count ("the 16-token block size does not change the number of sub-blocks", 4.2)."""
        return 2 * self.num_layers


@dataclass(frozen=True, slots=True)
class CxlCosts:
    """Beluga's pool: fixed terms of one load or store, and the link capacities `paths.py` builds."""

    block_tokens: int = 16  # (P) vLLM's native block is the pool's unit (4.2)
    launch_s: float = 8e-6  # (P) kernel launch + sync, ~75% of a 16 KB copy's 10.55 us (O5)
    per_chunk_s: float = 12e-9  # (I) Table 6: 211 us / 16,384 chunks = 12.9 ns; Llama 11.8 ns (6.7)
    rpc_rtt_s: float = 2.11e-6  # (P) CXL-RPC, 64 B, QD 1 (Exp #11)
    rpcs_per_load: int = 2  # (I) LOOKUP (with pin) before, UNPIN after (brief 4.5)
    rpcs_per_store: int = 2  # (I) ALLOC before, COMMIT after the gather kernel (brief 4.5)
    adapter_bytes_per_s: float = 26 * GB  # (P) GPU<->CXL through one x16 adapter, RC-bound (5.3)
    adapters_per_server: int = 2  # (P) one per socket (2.1)
    device_bytes_per_s: float = 22.5 * GB  # (P) one CXL memory device (5.3)
    num_devices: int = 32  # (P) 32 x 256 GB DDR5 (Table 2)
    device_bytes: float = 256 * GB  # (P)
    interleave_bytes: int = 2 << 20  # (P) software interleaving granule (5.3)
    pool_bytes: float = 2000 * GB  # (P) the evaluation caps the pool at 2 TB (6.1)

    load_overhead_s: float = 0.0  # (I) software time per load that the paper does not give: 0 = its figures

    def kernel_s(self, num_blocks: int, chunks_per_block: int) -> float:
        """One gather/scatter kernel for all of a request's blocks (O5): one launch, a cost per chunk."""
        return self.launch_s + num_blocks * chunks_per_block * self.per_chunk_s

    def load_fixed_s(self, num_blocks: int, chunks_per_block: int) -> float:
        """A load besides its bytes: LOOKUP and UNPIN RPCs and the scatter kernel (nothing hit: nothing)."""
        if num_blocks <= 0:
            return 0.0
        rpcs_s = self.rpcs_per_load * self.rpc_rtt_s
        return rpcs_s + self.kernel_s(num_blocks, chunks_per_block) + self.load_overhead_s

    def store_fixed_s(self, num_blocks: int, chunks_per_block: int) -> float:
        """A store besides its bytes: ALLOC and COMMIT RPCs and the gather kernel (nothing new: nothing)."""
        if num_blocks <= 0:
            return 0.0
        return self.rpcs_per_store * self.rpc_rtt_s + self.kernel_s(num_blocks, chunks_per_block)


@dataclass(frozen=True, slots=True)
class RdmaCosts:
    """The MoonCake-like baseline: fixed terms per object and per byte, and its link capacities."""

    object_tokens: int = 256  # (P) LMCache super block (Exp #8); 16 for the block-size sensitivity
    sge_per_wr: int = 30  # (P) ConnectX-7 sglist limit (6.1)
    wr_s: float = 9.62e-6  # (I) Table 6: 5,260 us for 16,384 chunks = 547 full WRs (0.32 us per chunk)
    rpc_rtt_s: float = 8.39e-6  # (P) RDMA-RC RPC, 64 B, QD 1 (Exp #11); one metadata RPC per object (I)
    launch_s: float = 8e-6  # (P) a copy kernel's launch + sync (O5); one per object to the bounce buffer (I)
    nic_bytes_per_s: float = 200 * GB  # (P) 4 x ConnectX-7 dual-port 200 Gbps per server (Table 2)
    pcie_bytes_per_s: float = 55.4 * GB  # (P) a GPU's PCIe bandwidth, bounce buffer <-> HBM (5.3)
    pool_bytes: float = 2000 * GB  # (P) capped at 2 TB like Beluga's (6.1)
    num_pool_servers: int = 2  # (P) the pool is the two GPU servers' DRAM (Table 2)
    local_dram_bytes: float = 40 * GB  # (I) LMCache local CPU tier per server: 8 x its 5 GB default
    object_overhead_s: float = 0.045  # (I, calibrated) per object a retrieve handles: get, allocation (7.1)
    copy_bytes_per_s: float = 0.8 * GB  # (I, calibrated) the retrieve's extra host copy (7.1)

    def wrs_per_object(self, chunks_per_object: int) -> int:
        """Work requests one object needs: its chunks, at most `sge_per_wr` per WR."""
        return math.ceil(chunks_per_object / self.sge_per_wr)

    def object_fixed_s(self, chunks_per_object: int, *, is_remote_tier: bool) -> float:
        """One loaded object's fixed cost: its allocation overhead and bounce-buffer kernel, plus for the RDMA
        pool (not the local DRAM tier) its metadata RPC and its work requests."""
        fixed = self.object_overhead_s + self.launch_s
        if is_remote_tier:
            fixed += self.rpc_rtt_s + self.wrs_per_object(chunks_per_object) * self.wr_s
        return fixed

    def load_fixed_s(
        self, num_pool_objects: int, num_local_objects: int, chunks_per_object: int, num_bytes: float
    ) -> float:
        """A request's load besides its link bytes: every object's fixed cost, then the extra host copy of all
        its bytes (one CPU thread per instance, I)."""
        pool = num_pool_objects * self.object_fixed_s(chunks_per_object, is_remote_tier=True)
        local = num_local_objects * self.object_fixed_s(chunks_per_object, is_remote_tier=False)
        return pool + local + num_bytes / self.copy_bytes_per_s

    def store_fixed_s(self, num_objects: int) -> float:
        """What a store holds the step for: each object's copy kernel into host memory. The put to the pool
        (RPC, work requests, NIC bytes, its copies) runs in the background (I: LMCache's remote put is
        asynchronous, while its retrieve blocks the step object by object)."""
        return num_objects * self.launch_s

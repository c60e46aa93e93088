"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from shared.blocks import blocks_for, context_buffer_bytes
from shared.config import DEFAULT_BLOCK_SIZE, BaseConfig, check, doc

ROLES = ("colocated", "prefill", "decode")
_PROMPTS = "; 0: two prompts of the model's full length, 256 MiB to 4 GiB"


def prompt_buffer_bytes(configured: int, full_block_bytes: int, max_model_len: int, block_size: int) -> int:
    """A buffer that holds whole prompts' KV (a DE buffer, a PE's staging or receive area): `configured`,
    or for 0 context_buffer_bytes of the model's full length. A fixed 256 MiB refused (429) every longer
    prompt of SmolLM2 on a disaggregated cluster, however idle."""
    return configured or context_buffer_bytes(blocks_for(max_model_len, block_size) * full_block_bytes)


@dataclass(slots=True)
class EngineConfig(BaseConfig):
    role: str = doc("colocated", "colocated (prefill + decode) | prefill | decode")
    model: str = doc("tiny", "model name (tiny, tiny-mla) or HF checkpoint directory")
    model_cache_dir: str = doc("", "where embedded models are materialized (default ~/.cache/kvpath/models)")
    device: str = doc("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = doc("", "model and KV dtype; default float32 on CPU, bfloat16 on CUDA")
    block_size: int = doc(DEFAULT_BLOCK_SIZE, "KV block size in tokens (same as the block store's)")
    kv_cache_bytes: int = doc(
        0,
        "bytes of paged KV cache (ignored when num_kv_blocks > 0); 0: room for two sequences of the model's "
        "full length, 256 MiB to 4 GiB (a serving GPU should be given more)",
    )
    num_kv_blocks: int = doc(0, "paged KV cache size in blocks; 0 derives it from kv_cache_bytes")
    max_num_seqs: int = doc(64, "most sequences in one decode batch")
    max_num_batched_tokens: int = doc(2048, "prefill token budget per step (chunked prefill beyond it)")
    step_target_s: float = doc(
        0.0,
        "size each step's prefill budget so a step takes about this long at the measured compute rate "
        "(64 tokens to max_num_batched_tokens); 0: the fixed budget",
    )
    warmup_prefill_tokens: int = doc(
        512,
        "one prefill of this many tokens at start: it measures the prefill rate the first load report "
        "carries (routers size admission by it); 0: none, the rate is unknown until the first prefill",
    )
    max_waiting: int = doc(1024, "tasks queued beyond this are refused (the router tries elsewhere or 429)")
    num_threads: int = doc(0, "torch CPU threads; 0 keeps torch's default")
    persist_kv: bool = doc(True, "persist every full block through the node's storage service")
    storage_staging_bytes: int = doc(
        0, "staging of the blocks persisted through storage; 0: two prefill steps' full blocks, >= 64 MiB"
    )
    kv_bind_host: str = doc(
        "127.0.0.1", "address the KV data-plane receiver listens on (prefill/decode roles)"
    )
    kv_backends: list[str] = doc(["shm", "rdma", "tcp"], "KV data-plane backends this engine may use")  # noqa: RUF009
    de_buffer_bytes: int = doc(0, f"decode role: DRAM buffer receiving prompt KV from PEs{_PROMPTS}")
    pe_receive_bytes: int = doc(0, f"prefill role: area receiving stored prefixes from DEs{_PROMPTS}")
    pe_staging_bytes: int = doc(0, f"prefill role: staging of KV sent to DE buffers{_PROMPTS}")
    transfer_timeout_s: float = doc(30.0, "deadline of one KV transfer or notice between engines")
    compute_quota_s: float = doc(
        0.3, "prefill role: predicted attention-layer time per batch, DualPath's quota (0: token budget)"
    )
    load_kv: bool = doc(True, "load stored prefix blocks instead of recomputing them")
    kv_pool: str = doc(
        "", "colocated, prefill or session engine: the KV pool (Beluga; `kvpath serve cxlpool`) above storage"
    )
    pool_verify_checksums: bool = doc(True, "check each pool block's checksum before using it")
    pool_lease_ms: int = doc(30_000, "how long a pool read lease or write allocation lives at most")
    pool_prefault: bool = doc(
        True, "map the whole pool's pages at start, in the background (first reads then take no page faults)"
    )
    pool_connect_timeout_s: float = doc(30.0, "how long to wait for the pool at start before going without")
    kv_remote: str = doc(
        "", "colocated role: the remote KV store (the RDMA-pool baseline; `kvpath serve remotekv`) to use"
    )
    remote_cache_bytes: int = doc(256 * 1024 * 1024, "remote tier: engine-local DRAM cache of super blocks")
    remote_verify_checksums: bool = doc(
        True, "remote tier: check each super block fetched from the store against its committed checksum"
    )
    remote_chunk_tokens: int = doc(256, "remote tier: tokens per super block (the store's chunk_tokens)")
    remote_timeout_s: float = doc(2.0, "remote tier: deadline of one store operation (metadata or bytes)")
    move_query: bool = doc(False, "colocated role: route held prefixes (move the query) and serve routes")
    hold_bytes: int = doc(0, "move_query: cache bytes this engine may pin as held chunks (0: holds none)")
    hold_min_tokens: int = doc(1024, "move_query: shortest prompt prefix worth holding, in tokens")
    hold_tenant_share: float = doc(
        0.5, "move_query: the share of hold_bytes one tenant's named chunks (`kv_chunk`) may pin"
    )
    route_timeout_s: float = doc(2.0, "move_query: deadline of one route exchange (then it falls back)")
    route_region_bytes: int = doc(64 * 1024 * 1024, "move_query: data-plane region for route queries/replies")
    session_kv: bool = doc(
        False, "decode role: keep each session's KV resident between turns, prefill turns sent here (AMPD)"
    )
    session_staging_bytes: int = doc(0, f"session engine: staging of resident KV sent to PEs{_PROMPTS}")
    prefill_order: str = doc(
        "fcfs", "prefill queue order: fcfs | slo (AMPD's Algorithm 2, TTFT-aware) | short-first"
    )
    short_first_ratio: float = doc(
        1.0, "short-first order: shorter prefills may pass a prefill for up to this x its own compute"
    )
    reorder_window: int = doc(3, "slo order: tasks tried in every order (w), also the postponement cap")
    ttft_slo_s: float = doc(2.0, "slo order: the TTFT SLO of a request that carries none")
    cost_profile: str = doc("", "slo order: cost profile of `kvpath profile` (default: the measured rate)")

    def validate(self) -> None:
        BaseConfig.validate(self)
        self._validate_remote()
        self._validate_move_query()
        self._validate_sessions()
        check(self.role in ROLES, "role", self.role, f"one of {', '.join(ROLES)}")
        check(
            not self.kv_pool or self.role in ("colocated", "prefill") or self.session_kv,
            "kv_pool",
            self.kv_pool,
            "only colocated, prefill and session decode engines use a pool",
        )
        check(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            self.block_size,
            "must be a power of two",
        )
        check(self.num_kv_blocks >= 0, "num_kv_blocks", self.num_kv_blocks, "must be >= 0")
        sized = ("kv_cache_bytes", "storage_staging_bytes", "de_buffer_bytes", "pe_receive_bytes")
        for name in (*sized, "pe_staging_bytes", "session_staging_bytes"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0 (0: sized by the model)")
        check(0 <= self.step_target_s <= 3600, "step_target_s", self.step_target_s, "between 0 and 3600")
        check(self.warmup_prefill_tokens >= 0, "warmup_prefill_tokens", self.warmup_prefill_tokens, ">= 0")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(
            self.max_num_batched_tokens >= self.block_size,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f"must be >= block_size={self.block_size}",
        )
        check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            self.device,
            "auto, cpu, cuda or cuda:N",
        )
        check(
            self.dtype in ("", "float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "float32, bfloat16 or float16",
        )

    def _validate_sessions(self) -> None:
        check(
            not self.session_kv or self.role == "decode",
            "session_kv",
            self.session_kv,
            "only decode engines keep sessions",
        )
        check(
            self.prefill_order in ("fcfs", "slo", "short-first"),
            "prefill_order",
            self.prefill_order,
            "fcfs, slo or short-first",
        )
        ratio = self.short_first_ratio
        check(0 <= ratio <= 100, "short_first_ratio", ratio, "between 0 and 100")
        check(1 <= self.reorder_window <= 6, "reorder_window", self.reorder_window, "between 1 and 6")
        check(self.ttft_slo_s > 0, "ttft_slo_s", self.ttft_slo_s, "must be > 0")

    def _validate_move_query(self) -> None:
        if not self.move_query:
            check(self.hold_bytes == 0, "hold_bytes", self.hold_bytes, "needs move_query")
            return
        check(self.role == "colocated", "move_query", self.move_query, "only colocated engines route")
        check(not self.kv_remote, "move_query", self.move_query, "not with the remote store tier")
        check(self.hold_bytes >= 0, "hold_bytes", self.hold_bytes, "must be >= 0")
        check(0 < self.hold_tenant_share <= 1, "hold_tenant_share", self.hold_tenant_share, "in (0, 1]")
        check(self.route_timeout_s > 0, "route_timeout_s", self.route_timeout_s, "must be > 0")
        check(self.route_region_bytes > 0, "route_region_bytes", self.route_region_bytes, "must be > 0")

    def _validate_remote(self) -> None:
        if not self.kv_remote:
            return
        check(
            self.role == "colocated", "kv_remote", self.kv_remote, "only colocated engines use a remote store"
        )
        check(
            not self.kv_pool,
            "kv_remote",
            self.kv_remote,
            f"one upper tier at a time (kv_pool={self.kv_pool!r})",
        )
        check(self.load_kv or self.persist_kv, "kv_remote", self.kv_remote, "needs load_kv or persist_kv")
        check(
            self.remote_chunk_tokens > 0 and self.remote_chunk_tokens % self.block_size == 0,
            "remote_chunk_tokens",
            self.remote_chunk_tokens,
            f"must be a positive multiple of block_size={self.block_size}",
        )
        check(self.remote_cache_bytes > 0, "remote_cache_bytes", self.remote_cache_bytes, "must be > 0")
        check(self.remote_timeout_s > 0, "remote_timeout_s", self.remote_timeout_s, "must be > 0")

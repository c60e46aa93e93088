"""Model presets of the simulator: KV bytes, layers, FLOPs and the per-GPU speeds that turn them into seconds.

The FLOP model is the brief's (section 1.3 / 6.4), which reproduces the paper's Table 1 cache-compute
ratios within ~10%: per token 2 x active parameters of linear FLOPs, plus per layer the context-proportional
attention part (dense GQA/MLA, or the DSA indexer of sparse models) in the form of
`services.engine.batching.attention_flops` with `attention_shape`, plus for DSA models the main attention
over min(context, top-k) keys (`sparse_flops_per_key` each). Nothing here comes from the paper except the
layer counts, head counts and top-k values; every speed and capacity is an [INF] default, overridable from
the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.policy.batching import AttentionShape, attention_flops
from shared.errors import ConfigError

GB = 1e9
MLA_BYTES_PER_LAYER_TOKEN = 656  # FP8 MLA: 512 B latent + 16 B scales + 128 B BF16 RoPE (brief 1.3, [INF])


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """Seconds of one decode step on a DE: `base_s + per_seq_s * batch + per_token_s * context tokens`."""

    base_s: float
    per_seq_s: float
    per_token_s: float

    def step_s(self, num_seqs: int, context_tokens: float) -> float:
        return self.base_s + self.per_seq_s * num_seqs + self.per_token_s * context_tokens


@dataclass(frozen=True, slots=True)
class SimModel:
    """A model as the simulator runs it: its KV and compute geometry plus the per-GPU speeds and capacities
    of a deployment (one engine per GPU). Not the runtime's `gpu.model_spec.ModelSpec` (a checkpoint kvpath
    serves): these presets describe models at paper scale that only the simulator runs."""

    name: str
    description: str
    num_layers: int
    kv_bytes_per_token: int  # all layers
    active_params: float
    attention_shape: AttentionShape  # context-proportional attention per layer (dense, or the DSA indexer)
    sparse_topk: int = 0  # DSA: keys per query of the main attention (0: dense model)
    sparse_flops_per_key: float = 0.0  # DSA: main-attention FLOPs per query and selected key, per layer
    num_attention_layers: int = 0  # layers with full attention (0: all); GPT-OSS alternates sliding windows
    default_pd: str = "1P1D"
    is_expert_parallel: bool = True  # EP: a node's PEs step together (attention is data-parallel)
    dram_buffer_bytes: float = 80 * GB  # per node (paper: 80 GB DeepSeek, 320 GB Qwen 32B)
    pe_kv_bytes: float = 30 * GB  # HBM for KV on a PE (caps a non-layerwise batch)
    de_kv_bytes: float = 50 * GB  # HBM for KV on a DE
    linear_flops_per_s: float = 5e14  # effective, per GPU
    attention_flops_per_s: float = 3e14  # effective, per GPU
    decode: DecodeModel = DecodeModel(0.030, 2.5e-5, 2.5e-9)

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.kv_bytes_per_token < 1 or self.active_params <= 0:
            raise ConfigError(f"model {self.name}: layers, KV bytes and active params must be positive")

    @property
    def attention_layers(self) -> int:
        return self.num_attention_layers or self.num_layers

    @property
    def kv_bytes_per_layer_token(self) -> float:
        return self.kv_bytes_per_token / self.num_layers

    def attention_layer_flops(self, cached_tokens: int, new_tokens: int) -> float:
        """FLOPs of one attention layer for `new_tokens` causal queries after `cached_tokens`."""
        flops = attention_flops(cached_tokens, new_tokens, self.attention_shape)
        if self.sparse_topk:
            # every query attends min(its position, top-k) keys; the batch's middle query stands for all
            keys = min(cached_tokens + (new_tokens + 1) / 2, self.sparse_topk)
            flops += self.sparse_flops_per_key * new_tokens * keys
        return flops

    def linear_layer_flops(self, new_tokens: int) -> float:
        """Non-attention FLOPs of one layer (2 x active params per token, spread over the layers)."""
        return 2.0 * self.active_params * new_tokens / self.num_layers

    def attention_flops_per_query(self, context_tokens: int) -> float:
        """All layers' attention FLOPs of one query over `context_tokens` (the Table 1 model)."""
        per_layer = attention_flops(context_tokens, 1, self.attention_shape) - attention_flops(
            0, 1, self.attention_shape
        )
        if self.sparse_topk:
            per_layer += self.sparse_flops_per_key * min(context_tokens, self.sparse_topk)
        return self.attention_layers * per_layer


# DS 27B (paper 7.3): hidden 2560, 30 layers (1 dense, FFN 12288; 29 MoE, 6 routed + 2 shared experts of
# 1536), 32 MLA heads, indexer 32 heads x 64, top-k 1024, no q LoRA. [INF] active params per layer: FFN
# 8 x 3 x 2560 x 1536 = 94.4M (the dense layer's 3 x 2560 x 12288 is the same), MLA 31.9M (q 2560x32x192,
# kv_a 2560x576, kv_b 512x32x256, o 32x128x2560), indexer 5.5M: 131.8M x 30 = 3.95B. Weights ~27 GB FP8
# over EP8. Decode: ~20 ms per step (EP all-to-all, launches); per sequence the top-k KV (1024 x 656 B x 30
# = 20 MB, ~6 us at 3.35 TB/s) and per context token the indexer keys (~2 KB, ~0.6 ns), padded for overheads.
DS27B = SimModel(
    name="ds27b",
    description="DS 27B: downscaled DeepSeek-V3.2 (MLA + DSA top-k 1024), 30 layers, EP+DP, 1P1D",
    num_layers=30,
    kv_bytes_per_token=MLA_BYTES_PER_LAYER_TOKEN * 30,
    active_params=3.95e9,
    attention_shape=AttentionShape(num_q_heads=32, head_dim=32),  # indexer: 2 x 32 heads x 64 per key
    sparse_topk=1024,
    sparse_flops_per_key=2 * 32 * (576 + 512),  # absorbed MLA, 32 heads
    default_pd="1P1D",
    pe_kv_bytes=60 * GB,
    de_kv_bytes=65 * GB,
    linear_flops_per_s=3e14,  # small GEMMs (hidden 2560) run well below the FP8 peak
    attention_flops_per_s=2e14,
    decode=DecodeModel(0.020, 2e-5, 1e-9),
)

# DS 660B = DeepSeek-V3.2: 61 layers, 128 MLA heads, indexer 64 heads x 128, top-k 2048, 37B active. [INF]
# weights 671 GB FP8: EP32 over 4 decode nodes leaves ~50 GB of an 80 GB GPU for KV, EP16 on 2 prefill nodes
# ~30 GB. Decode: per sequence the top-k KV (2048 x 656 B x 61 = 82 MB, ~25 us), per context token the
# indexer keys (~8 KB, ~2.4 ns); the fixed part is set so a step is ~35 ms at the paper's loads (Table 3:
# TPOT 36-39 ms).
DS660B = SimModel(
    name="ds660b",
    description="DS 660B: DeepSeek-V3.2 (MLA + DSA top-k 2048), 61 layers, EP+DP, 2P4D",
    num_layers=61,
    kv_bytes_per_token=MLA_BYTES_PER_LAYER_TOKEN * 61,
    active_params=37e9,
    attention_shape=AttentionShape(num_q_heads=64, head_dim=64),  # indexer: 2 x 64 heads x 128 per key
    sparse_topk=2048,
    sparse_flops_per_key=2 * 128 * (576 + 512),
    default_pd="2P4D",
    pe_kv_bytes=30 * GB,
    de_kv_bytes=50 * GB,
    decode=DecodeModel(0.032, 2.5e-5, 2.5e-9),
)

# Qwen2.5-32B: 64 layers, GQA 40 query / 8 KV heads x 128, FP16 KV (256 KiB/token), 32.5B params, DP only.
# [INF] FP8 weights (DeepGEMM) leave ~39 GB for KV; decode reads its weights (32.5 GB: ~10 ms) and every
# context token's 256 KiB of KV (78 ns) from 3.35 TB/s HBM.
QWEN32B = SimModel(
    name="qwen32b",
    description="Qwen2.5-32B: dense GQA, FP16 KV, 64 layers, DP only, 1P2D",
    num_layers=64,
    kv_bytes_per_token=2 * 64 * 8 * 128 * 2,
    active_params=32.5e9,
    attention_shape=AttentionShape(num_q_heads=40, head_dim=128),
    default_pd="1P2D",
    is_expert_parallel=False,
    dram_buffer_bytes=320 * GB,
    pe_kv_bytes=35 * GB,
    de_kv_bytes=39 * GB,
    linear_flops_per_s=4e14,
    attention_flops_per_s=3e14,
    decode=DecodeModel(0.012, 5e-5, 7.8e-8),
)

# Table 1 only (brief 6.4): not simulated configurations, kept to check the FLOP model.
REFERENCE_MODELS = {
    "gpt-oss-120b": SimModel(
        name="gpt-oss-120b",
        description="GPT-OSS-120B: 18 full-attention layers of 36, FP8 KV",
        num_layers=36,
        num_attention_layers=18,
        kv_bytes_per_token=2 * 18 * 8 * 64,
        active_params=5.1e9,
        attention_shape=AttentionShape(num_q_heads=64, head_dim=64),
    ),
    "qwen3-235b": SimModel(
        name="qwen3-235b",
        description="Qwen3-235B-A22B: 94 layers, GQA 4 KV heads, FP8 KV",
        num_layers=94,
        kv_bytes_per_token=2 * 94 * 4 * 128,
        active_params=22e9,
        attention_shape=AttentionShape(num_q_heads=64, head_dim=128),
    ),
    "deepseek-v3": replace(
        DS660B,
        name="deepseek-v3",
        description="DeepSeek-V3: dense MLA",
        attention_shape=AttentionShape(num_q_heads=128, head_dim=(576 + 512) // 2),
        sparse_topk=0,
        sparse_flops_per_key=0.0,
    ),
}

MODELS: dict[str, SimModel] = {m.name: m for m in (DS27B, DS660B, QWEN32B)}


def get_model(name: str) -> SimModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}: one of {', '.join(MODELS)}", param="model") from None

"""config.json of a Hugging Face checkpoint, parsed into the hyperparameters this runtime needs.

Pure Python (no torch): the router reads model geometry through `gpu.model_spec`, which builds on this.
Both config spellings are accepted: transformers 5 (`rope_parameters` holding `rope_theta`) and the older
one (`rope_theta` at the top level plus `rope_scaling`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu.errors import CheckpointError, UnsupportedModelError

# architecture name in config.json -> attention variant
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "gqa",
    "Qwen2ForCausalLM": "gqa",
    "DeepseekV2ForCausalLM": "mla",
}
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (the subset of HF `rope_parameters` the supported types use)."""

    rope_type: str
    theta: float
    dim: int  # rotated dims per head (DeepSeek rotates adjacent pairs, Llama/Qwen2 the two halves)
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """Decoder hyperparameters. GQA fields are meaningful for "gqa", the MLA ones for "mla"."""

    architecture: str
    attention: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    has_o_bias: bool
    has_mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False

    @property
    def kv_dim(self) -> int:
        """Cache elements per token per layer: GQA K then V; MLA normalized latent then rope key."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        if self.attention != "mla":
            return self.head_dim**-0.5
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            mscale = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= mscale * mscale
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % max(self.moe_layer_freq, 1) == 0
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: top level must be a JSON object")
    return data


def load_arch_config(model_dir: str | Path) -> ArchConfig:
    """Parse `<model_dir>/config.json` (+ generation_config.json for EOS ids)."""
    model_dir = Path(model_dir)
    raw = read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    generation = read_json(gen_path) if gen_path.exists() else {}
    return parse_arch_config(raw, generation, source=str(model_dir / "config.json"))


def read_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids as generation uses them (generation_config.json, else config.json); no architecture check."""
    model_dir = Path(model_dir)
    ids: tuple[int, ...] = ()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            value = read_json(path).get("eos_token_id")
            ids = _eos_ids(value) if value is not None else ids
    return ids


def parse_arch_config(
    raw: dict[str, Any], generation: dict[str, Any], *, source: str = "config.json"
) -> ArchConfig:
    get = _Getter(raw, source)
    common = _common_fields(get, _supported_architecture(raw, source), generation)
    if common["attention"] == "mla":
        return _parse_mla(raw, get, common)
    if common["num_heads"] % common["num_kv_heads"]:
        raise CheckpointError(f"{source}: num_attention_heads not a multiple of num_key_value_heads")
    return ArchConfig(**common, rope=_parse_rope(raw, get, dim=common["head_dim"]))


def _supported_architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    supported = [a for a in archs if a in ARCHITECTURES]
    if not supported:
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {archs or 'None'}; supported: {', '.join(ARCHITECTURES)}",
            param="architectures",
        )
    if (raw.get("hidden_act") or "silu") != "silu":
        raise UnsupportedModelError(
            f"{source}: hidden_act={raw['hidden_act']!r} is not supported (silu only)"
        )
    if supported[0] == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: Qwen2 sliding-window attention is not supported")
    return supported[0]


def _common_fields(get: _Getter, arch: str, generation: dict[str, Any]) -> dict[str, Any]:
    raw = get.raw
    num_heads = get.req_int("num_attention_heads")
    hidden = get.req_int("hidden_size")
    return dict(
        architecture=arch,
        attention=ARCHITECTURES[arch],
        vocab_size=get.req_int("vocab_size"),
        hidden_size=hidden,
        num_layers=get.req_int("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // max(num_heads, 1)),
        intermediate_size=get.req_int("intermediate_size"),
        rms_norm_eps=float(get.opt("rms_norm_eps", 1e-6)),
        max_position_embeddings=get.req_int("max_position_embeddings"),
        tie_word_embeddings=bool(get.opt("tie_word_embeddings", False)),
        has_qkv_bias=arch == "Qwen2ForCausalLM" or bool(get.opt("attention_bias", False)),
        has_o_bias=arch == "LlamaForCausalLM" and bool(get.opt("attention_bias", False)),
        has_mlp_bias=bool(get.opt("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(generation.get("eos_token_id", raw.get("eos_token_id"))),
    )


def _parse_mla(raw: dict[str, Any], get: _Getter, common: dict[str, Any]) -> ArchConfig:
    rope_dim = get.req_int("qk_rope_head_dim")
    rope = _parse_rope(raw, get, dim=rope_dim)
    topk_method = str(get.opt("topk_method", "greedy"))
    if topk_method not in TOPK_METHODS:
        raise UnsupportedModelError(f"{get.source}: topk_method={topk_method!r} is not supported")
    n_routed = int(raw.get("n_routed_experts") or 0)
    has_bias = bool(get.opt("attention_bias", False))  # q_a_proj, kv_a_proj_with_mqa and o_proj
    return ArchConfig(
        **{**common, "has_qkv_bias": has_bias, "has_o_bias": has_bias},
        rope=rope,
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=get.req_int("kv_lora_rank"),
        qk_nope_head_dim=get.req_int("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=get.req_int("v_head_dim"),
        n_routed_experts=n_routed,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        topk_method=topk_method,
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob") or False),
    )


def _parse_rope(raw: dict[str, Any], get: _Getter, *, dim: int) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{get.source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{get.source}: partial_rotary_factor is not supported")
    original_max = int(params.get("original_max_position_embeddings") or raw["max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = raw["max_position_embeddings"] / original_max if rope_type == "yarn" else 1.0

    def opt_float(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        dim=dim,
        factor=float(factor),
        original_max_position_embeddings=original_max,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=opt_float("mscale"),
        mscale_all_dim=opt_float("mscale_all_dim"),
        attention_factor=opt_float("attention_factor"),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        truncate=bool(params.get("truncate", True)),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


class _Getter:
    """Reads required fields with an error naming the file and the key."""

    __slots__ = ("raw", "source")

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def req_int(self, key: str) -> int:
        value = self.raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(
                f"{self.source}: {key} must be a non-negative integer, got {value!r}", param=key
            )
        return value

    def opt(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

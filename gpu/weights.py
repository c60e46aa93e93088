"""Safetensors loading, single file or sharded (model.safetensors.index.json), checked against config.

Every tensor the config implies must be present with the implied shape, and hold finite values; otherwise a
`CheckpointError` names the tensor (and the file). Routed experts may be stored per expert (the original
DeepSeek layout, also what `save_pretrained` writes) or fused (`experts.gate_up_proj` [E, 2I, H]).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from gpu.arch_config import ArchConfig
from gpu.errors import CheckpointError

Shape = tuple[int, ...]


def expected_shapes(arch: ArchConfig, present: set[str]) -> dict[str, Shape]:
    """Name -> shape of every tensor the runtime reads (`present` picks among equivalent layouts)."""
    hidden = arch.hidden_size
    shapes: dict[str, Shape] = {
        "model.embed_tokens.weight": (arch.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        attention = _mla_shapes if arch.attention == "mla" else _gqa_shapes
        shapes.update(attention(arch, prefix + "self_attn."))
        if arch.is_moe_layer(layer):
            shapes.update(_moe_shapes(arch, prefix + "mlp.", present))
        else:
            shapes.update(_swiglu_shapes(prefix + "mlp.", hidden, arch.intermediate_size, arch.has_mlp_bias))
    return shapes


def _gqa_shapes(arch: ArchConfig, prefix: str) -> dict[str, Shape]:
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes: dict[str, Shape] = {
        prefix + "q_proj.weight": (q_dim, arch.hidden_size),
        prefix + "k_proj.weight": (kv_dim, arch.hidden_size),
        prefix + "v_proj.weight": (kv_dim, arch.hidden_size),
        prefix + "o_proj.weight": (arch.hidden_size, q_dim),
    }
    if arch.has_qkv_bias:
        shapes.update({prefix + "q_proj.bias": (q_dim,), prefix + "k_proj.bias": (kv_dim,)})
        shapes[prefix + "v_proj.bias"] = (kv_dim,)
    if arch.has_o_bias:
        shapes[prefix + "o_proj.bias"] = (arch.hidden_size,)
    return shapes


def _mla_shapes(arch: ArchConfig, prefix: str) -> dict[str, Shape]:
    hidden, heads = arch.hidden_size, arch.num_heads
    rank, rope = arch.kv_lora_rank, arch.qk_rope_head_dim
    q_dim = heads * (arch.qk_nope_head_dim + rope)
    shapes: dict[str, Shape] = {
        prefix + "kv_a_proj_with_mqa.weight": (rank + rope, hidden),
        prefix + "kv_a_layernorm.weight": (rank,),
        prefix + "kv_b_proj.weight": (heads * (arch.qk_nope_head_dim + arch.v_head_dim), rank),
        prefix + "o_proj.weight": (hidden, heads * arch.v_head_dim),
    }
    if arch.q_lora_rank is None:
        shapes[prefix + "q_proj.weight"] = (q_dim, hidden)
    else:
        shapes[prefix + "q_a_proj.weight"] = (arch.q_lora_rank, hidden)
        shapes[prefix + "q_a_layernorm.weight"] = (arch.q_lora_rank,)
        shapes[prefix + "q_b_proj.weight"] = (q_dim, arch.q_lora_rank)
    if arch.has_qkv_bias:
        shapes[prefix + "kv_a_proj_with_mqa.bias"] = (rank + rope,)
        if arch.q_lora_rank is not None:
            shapes[prefix + "q_a_proj.bias"] = (arch.q_lora_rank,)
    if arch.has_o_bias:
        shapes[prefix + "o_proj.bias"] = (hidden,)
    return shapes


def _moe_shapes(arch: ArchConfig, prefix: str, present: set[str]) -> dict[str, Shape]:
    hidden, inner, experts = arch.hidden_size, arch.moe_intermediate_size, arch.n_routed_experts
    shapes: dict[str, Shape] = {prefix + "gate.weight": (experts, hidden)}
    if prefix + "experts.gate_up_proj" in present:
        shapes[prefix + "experts.gate_up_proj"] = (experts, 2 * inner, hidden)
        shapes[prefix + "experts.down_proj"] = (experts, hidden, inner)
    else:
        for expert in range(experts):
            shapes.update(_swiglu_shapes(f"{prefix}experts.{expert}.", hidden, inner, False))
    if arch.n_shared_experts:
        shapes.update(
            _swiglu_shapes(prefix + "shared_experts.", hidden, inner * arch.n_shared_experts, False)
        )
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, inner: int, has_bias: bool) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {
        prefix + "gate_proj.weight": (inner, hidden),
        prefix + "up_proj.weight": (inner, hidden),
        prefix + "down_proj.weight": (hidden, inner),
    }
    if has_bias:
        shapes.update({prefix + "gate_proj.bias": (inner,), prefix + "up_proj.bias": (inner,)})
        shapes[prefix + "down_proj.bias"] = (hidden,)
    return shapes


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file from the shard index; {} means "scan the single file(s)"."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return {}
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid shard index ({exc})") from exc
    return {name: model_dir / file for name, file in weight_map.items()}


def load_weights(
    model_dir: str | Path, arch: ArchConfig, *, device: str, dtype: torch.dtype
) -> dict[str, Any]:
    """Every tensor the runtime needs, checked, converted to `dtype` and placed on `device`."""
    model_dir = Path(model_dir)
    with ExitStack() as stack:
        handles = _open_all(model_dir, stack)
        expected = expected_shapes(arch, set(handles))
        for name, shape in expected.items():
            if name not in handles:
                raise CheckpointError(
                    f"checkpoint {model_dir} is missing tensor {name} (shape {list(shape)})"
                )
            actual = tuple(handles[name].get_slice(name).get_shape())
            if actual != shape:
                raise CheckpointError(
                    f"tensor {name} has shape {list(actual)} but config.json implies {list(shape)}"
                )
        return {name: _load_one(handles[name], name, device, dtype) for name in expected}


def _load_one(handle: Any, name: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        tensor = handle.get_tensor(name)
    except Exception as exc:
        raise CheckpointError(f"cannot read tensor {name}: {exc}") from exc
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"tensor {name} contains NaN or infinite values (corrupt checkpoint?)")
    return tensor.to(device=device, dtype=dtype)


def _open_all(model_dir: Path, stack: ExitStack) -> dict[str, Any]:
    from safetensors import safe_open

    by_name = checkpoint_files(model_dir)
    files = sorted(set(by_name.values())) if by_name else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights (other formats are not supported)")
    opened: dict[Path, Any] = {}
    for path in files:
        if not path.is_file():
            names = [n for n, f in by_name.items() if f == path][:3]
            raise CheckpointError(f"shard {path.name} (holding tensor {', '.join(names)}) is missing")
        try:
            opened[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except Exception as exc:
            raise CheckpointError(f"{path}: corrupt safetensors file ({exc})") from exc
    handles: dict[str, Any] = {}
    for path, handle in opened.items():
        for name in handle.keys():
            if not by_name or by_name.get(name) == path:
                handles[name] = handle
    return handles

"""GGUF tensors -> the runtime's weights: dequantized with the `gguf` package (NumPy), renamed to
transformers' names, and Q/K rows put back in transformers' order.

llama.cpp's converter permutes the rows of Llama's q_proj/k_proj so each head's RoPE pairs sit next to each
other; this module undoes that, so GGUF and safetensors checkpoints reach the attention code alike (it
applies its own pairing, `gpu.rope.interleave_halves`). Qwen2 files are not permuted. Every tensor is checked
by name and shape against the config and must hold finite values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpu.arch_config import ArchConfig
from gpu.errors import CheckpointError, UnsupportedModelError
from gpu.gguf_file import GgufFile, open_gguf
from gpu.weights import expected_shapes

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str | None:
    """transformers' name of a GGUF tensor (None: a tensor this runtime has no use for)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_gguf_weights(
    path: str | Path, arch: ArchConfig, *, device: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor the runtime needs, dequantized, checked, converted to `dtype` and placed on `device`."""
    gguf = open_gguf(path)
    by_hf = {name: t for t in gguf.reader.tensors if (name := hf_name(t.name)) is not None}
    expected = expected_shapes(arch, set(by_hf))
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        if name not in by_hf:
            raise CheckpointError(f"{gguf.path} is missing the tensor for {name} (shape {list(shape)})")
        array = _dequantize(gguf, by_hf[name])
        if tuple(array.shape) != shape:
            raise CheckpointError(
                f"{gguf.path}: tensor {by_hf[name].name} has shape {list(array.shape)} but the metadata "
                f"implies {list(shape)}"
            )
        tensor = torch.from_numpy(array)
        if arch.architecture == "LlamaForCausalLM":
            tensor = _unpermute(name, tensor, arch)
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{gguf.path}: tensor {by_hf[name].name} holds NaN or infinite values")
        out[name] = tensor.to(device=device, dtype=dtype)
    return out


def _dequantize(gguf: GgufFile, tensor: object) -> np.ndarray:
    from gguf import quants

    kind = tensor.tensor_type  # type: ignore[attr-defined]
    try:
        array = quants.dequantize(tensor.data, kind)  # type: ignore[attr-defined]
    except NotImplementedError:
        raise UnsupportedModelError(
            f"{gguf.path}: tensor {tensor.name} uses quantization {kind.name}, "  # type: ignore[attr-defined]
            "which the gguf package cannot dequantize"
        ) from None
    array = np.ascontiguousarray(array, dtype=np.float32)
    return array if array.flags.writeable else array.copy()  # F32 tensors are views of the read-only map


def _unpermute(name: str, tensor: torch.Tensor, arch: ArchConfig) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, (x0, x_half, x1, x_half+1, ...) back to two halves."""
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
        heads = arch.num_heads
    elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
        heads = arch.num_kv_heads
    else:
        return tensor
    rest = tensor.shape[1:]
    half = tensor.shape[0] // heads // 2
    return tensor.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(tensor.shape).contiguous()

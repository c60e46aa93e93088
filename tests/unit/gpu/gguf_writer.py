"""Write the embedded `tiny` checkpoint as a GGUF file the way llama.cpp's converter does (test helper).

Tensor names, the Q/K row permutation and the metadata keys follow the GGUF format; the tokenizer is a
byte-level BPE with the 256 byte symbols, ChatML markers as control tokens and one merge.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (a property of the byte-level format)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two halves interleaved."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_tiny_gguf(
    model_dir: Path,
    out: Path,
    *,
    quant: str = "F32",
    arch: str = "llama",
    drop: tuple[str, ...] = (),
    overrides: dict[str, Any] | None = None,
) -> Path:
    """`model_dir`: the tiny HF folder; `quant` "F32" or "Q8_0" for the matrices."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    _metadata(writer, config, arch, overrides or {})
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, array in sorted(weights.items()):
        if gguf_name(name) in drop:
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            array = permute_rows(array, heads)
        if array.ndim == 2 and quant != "F32":
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _metadata(writer: Any, config: dict[str, Any], arch: str, overrides: dict[str, Any]) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    tokens = [*byte_symbols(), *SPECIAL, "he"]  # ids 0-255 the bytes, 256-258 control, 259 a merge
    assert len(tokens) == config["vocab_size"]
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 3, 1])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for key, value in overrides.items():
        writer.add_string(key, value)

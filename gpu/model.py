"""The decoder: embedding, N x (RMSNorm -> attention -> RMSNorm -> MLP/MoE), final norm, LM head.

Plain tensors and functions, no nn.Module: the runner calls `embed`, `layer` (once per layer, so a caller can
interleave KV transfers between layers) and `logits`. All methods must run under torch.inference_mode().
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from gpu.arch_config import ArchConfig
from gpu.attention import GqaAttention, KVLayer, MlaAttention
from gpu.batch import ForwardBatch
from gpu.gguf_file import is_gguf
from gpu.gguf_weights import load_gguf_weights
from gpu.layers import DenseMlp, MoeMlp, rms_norm
from gpu.linear import Linear
from gpu.rope import RotaryTable
from gpu.weights import load_weights


class DecoderLayer:
    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], layer: int) -> None:
        prefix = f"model.layers.{layer}."
        self.eps = arch.rms_norm_eps
        self.input_norm = weights.pop(prefix + "input_layernorm.weight")
        self.post_norm = weights.pop(prefix + "post_attention_layernorm.weight")
        attention = MlaAttention if arch.attention == "mla" else GqaAttention
        self.attention: GqaAttention | MlaAttention = attention(arch, weights, prefix + "self_attn.")
        self.mlp: DenseMlp | MoeMlp = (
            MoeMlp(arch, weights, prefix + "mlp.")
            if arch.is_moe_layer(layer)
            else DenseMlp(weights, prefix + "mlp.")
        )

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: KVLayer) -> torch.Tensor:
        h = x + self.attention.forward(rms_norm(x, self.input_norm, self.eps), batch, kv)
        return h + self.mlp(rms_norm(h, self.post_norm, self.eps))


class Transformer:
    def __init__(
        self, arch: ArchConfig, weights: dict[str, torch.Tensor], *, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.embedding = weights.pop("model.embed_tokens.weight")
        lm_head = weights.pop("lm_head.weight", None)
        self.lm_head = Linear(self.embedding if lm_head is None else lm_head, None)
        self.final_norm = weights.pop("model.norm.weight")
        self.layers = [DecoderLayer(arch, weights, layer) for layer in range(arch.num_layers)]
        assert not weights, f"tensors loaded but not used: {sorted(weights)[:5]}"
        initial_len = min(arch.max_position_embeddings, 4096)
        self.rotary = RotaryTable(arch.rope, device=device, initial_len=initial_len)
        self._scratch = torch.empty(0, dtype=dtype, device=device)  # decode context gathers, grown on demand

    def _attach_scratch(self, batch: ForwardBatch, kv_tensor: torch.Tensor) -> None:
        """Decode gathers reuse one buffer (no multi-MB allocation per layer and step). Single worker
        thread: one forward at a time uses it."""
        if batch.context_blocks is None or batch.context_out is not None:
            return
        block_size, kv_dim = kv_tensor.shape[2], kv_tensor.shape[3]
        needed = batch.context_blocks.shape[1] * block_size * kv_dim
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(-(-needed // 65536) * 65536, dtype=self.dtype, device=self.device)
        batch.context_out = self._scratch[:needed].view(-1, block_size, kv_dim)

    @classmethod
    def load(cls, model_dir: str | Path, arch: ArchConfig, *, device: str, dtype: torch.dtype) -> Transformer:
        if is_gguf(model_dir):
            weights = load_gguf_weights(model_dir, arch, device=device, dtype=dtype)
        else:
            weights = load_weights(model_dir, arch, device=device, dtype=dtype)
        return cls(arch, weights, device=torch.device(device), dtype=dtype)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return F.embedding(batch.token_ids, self.embedding)

    def layer(
        self, index: int, hidden: torch.Tensor, batch: ForwardBatch, kv_tensor: torch.Tensor
    ) -> torch.Tensor:
        """Run layer `index`: writes the new tokens' KV of that layer into the cache; the new hidden."""
        self._attach_scratch(batch, kv_tensor)
        return self.layers[index](hidden, batch, KVLayer(kv_tensor, index))

    def logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits [len(batch.logit_rows), vocab]."""
        rows = hidden.index_select(0, batch.logit_rows)
        return self.lm_head(rms_norm(rows, self.final_norm, self.arch.rms_norm_eps)).float()

    def forward(self, batch: ForwardBatch, kv_tensor: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(batch)
        for index in range(len(self.layers)):
            hidden = self.layer(index, hidden, batch, kv_tensor)
        return self.logits(hidden, batch)

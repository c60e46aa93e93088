"""Attention over the paged cache: GQA (Llama, Qwen2) and MLA (DeepSeek-V2).

Every layer first writes the new tokens' cache rows, then attends over the context read back from the cache,
so KV supplied from outside (import_layer before the layer runs) and KV computed here are treated alike.
Decode gathers every sequence's context rows (padded to the longest context, padding masked) and runs one
batched attention, with no per-sequence Python loop; prefill attends per sequence (different cached
lengths, causal over the new tokens).

MLA cache row = [normalized latent (kv_lora_rank) ; rope-applied key (qk_rope_head_dim)]. Decode and short
prefill chunks use the absorbed form (query folded through W_UK, attention against the rows themselves as one
shared key/value head, output unfolded through W_UV); long prefill chunks expand the latent per head instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.arch_config import ArchConfig
from gpu.batch import ForwardBatch, SeqSpan
from gpu.layers import rms_norm
from gpu.linear import Linear
from gpu.rope import apply_rotary, interleave_halves

SCORE_ELEMENTS = 1 << 24  # bound on one [heads, queries, keys] score chunk of absorbed MLA prefill


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kwargs: object) -> torch.Tensor:
    """q [B, H, n, d], k [B, Hkv, S, d], v [B, Hkv, S, dv] -> [B, H, n, dv]."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa, **kwargs)  # type: ignore[arg-type]


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, computed in fp32 for half-precision scores."""
    if scores.dtype == torch.float32:
        return scores.softmax(dim=-1)
    return scores.softmax(dim=-1, dtype=torch.float32).to(scores.dtype)


def _causal_mask(span: SeqSpan, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(span.num_cached, span.context_len, device=device)
    return torch.arange(span.context_len, device=device)[None, :] <= q_pos[:, None]


class KVLayer:
    """Layer `layer` of the paged cache as the attention code uses it: writes scatter token rows with
    index_copy_; reads gather whole Layer Blocks with index_select."""

    __slots__ = ("block_size", "by_layer_block", "flat", "layer", "num_layers")

    def __init__(self, tensor: torch.Tensor, layer: int) -> None:
        num_blocks, self.num_layers, self.block_size, kv_dim = tensor.shape
        self.layer = layer
        self.by_layer_block = tensor.view(num_blocks * self.num_layers, self.block_size, kv_dim)
        self.flat = tensor.view(-1, kv_dim)

    def write(self, batch: ForwardBatch, rows: torch.Tensor) -> None:
        self.flat.index_copy_(0, batch.slot_rows[self.layer], rows)

    def _gather(self, block_table: torch.Tensor) -> torch.Tensor:
        return self.by_layer_block.index_select(0, block_table.flatten() * self.num_layers + self.layer)

    def context(self, span: SeqSpan) -> torch.Tensor:
        """[context_len, kv_dim] of one sequence (a gathered copy)."""
        return self._gather(span.block_table).flatten(0, 1)[: span.context_len]

    def padded_contexts(self, batch: ForwardBatch) -> torch.Tensor:
        """[B, longest context, kv_dim] for decode (shorter contexts' padding masked by batch.key_bias),
        gathered Layer Block by Layer Block into the batch's scratch buffer (reused by every layer)."""
        assert (
            batch.context_blocks is not None and batch.context_out is not None and batch.key_bias is not None
        )
        torch.index_select(self.by_layer_block, 0, batch.context_blocks[self.layer], out=batch.context_out)
        rows = batch.context_out.view(batch.key_bias.shape[0], -1, self.flat.shape[1])
        return rows[:, : batch.key_bias.shape[-1]]


class GqaAttention:
    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.scale = arch.softmax_scale
        for name, heads in (("q_proj", self.num_heads), ("k_proj", self.num_kv_heads)):  # RoPE pairs adjacent
            for kind in ("weight", "bias"):
                key = f"{prefix}{name}.{kind}"
                if key in weights:
                    weights[key] = interleave_halves(weights[key], heads)
        self.qkv = Linear.fused(weights, [prefix + n for n in ("q_proj", "k_proj", "v_proj")])
        self.o_proj = Linear.fused(weights, [prefix + "o_proj"])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVLayer) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk = apply_rotary(
            qkv[:, : (heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim), batch.rope
        ).to(x.dtype)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * head_dim :]
        kv.write(batch, torch.cat((k.reshape(num_tokens, -1), v), dim=-1))
        if batch.routed is not None:  # context held elsewhere: partials merged (partial_attention*)
            out = batch.routed.attend(kv, q, self.split_rows, self.scale)
            return self.o_proj(out.reshape(num_tokens, -1))
        if batch.is_decode:
            out = self._decode(q, batch, kv)
        else:
            out = torch.cat([self._prefill_one(q, k, v, span, kv) for span in batch.spans])
        return self.o_proj(out)

    def split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [S, kv_dim] -> K, V [S, Hkv, head_dim] (views)."""
        half = self.num_kv_heads * self.head_dim
        shape = (rows.shape[0], self.num_kv_heads, self.head_dim)
        return rows[:, :half].view(shape), rows[:, half:].view(shape)

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [..., S, kv_dim] -> K, V [..., Hkv, S, head_dim]."""
        half = self.num_kv_heads * self.head_dim
        shape = (*rows.shape[:-1], self.num_kv_heads, self.head_dim)
        return rows[..., :half].view(shape).transpose(-3, -2), rows[..., half:].view(shape).transpose(-3, -2)

    def _decode(self, q: torch.Tensor, batch: ForwardBatch, kv: KVLayer) -> torch.Tensor:
        # the query heads sharing a KV head become that head's query rows (one position per sequence, so
        # they share the mask): no GQA expansion of K/V
        k, v = self._split(kv.padded_contexts(batch))
        q = q.view(q.shape[0], self.num_kv_heads, -1, self.head_dim)
        out = _sdpa(q, k, v, self.scale, attn_mask=batch.key_bias)
        return out.reshape(q.shape[0], -1)

    def _prefill_one(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: SeqSpan, kv: KVLayer
    ) -> torch.Tensor:
        q_span = q[span.start : span.start + span.num_new].transpose(0, 1)[None]
        if span.num_cached == 0:  # everything is new: attend to the fresh K/V, plain causal
            k_span = k[span.start : span.start + span.num_new].transpose(0, 1)[None]
            v_span = v[span.start : span.start + span.num_new].view(span.num_new, self.num_kv_heads, -1)
            out = _sdpa(q_span, k_span, v_span.transpose(0, 1)[None], self.scale, is_causal=True)
        else:
            k_ctx, v_ctx = self._split(kv.context(span))
            mask = _causal_mask(span, q.device)
            out = _sdpa(q_span, k_ctx[None], v_ctx[None], self.scale, attn_mask=mask)
        return out[0].transpose(0, 1).reshape(span.num_new, -1)


class MlaAttention:
    # "auto" picks per sequence by cost; tests pin "absorbed" or "expanded" to check both against each other
    prefill_mode = "auto"

    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.num_heads, self.rank, self.rope_dim = arch.num_heads, arch.kv_lora_rank, arch.qk_rope_head_dim
        self.nope_dim, self.v_dim = arch.qk_nope_head_dim, arch.v_head_dim
        self.eps, self.scale = arch.rms_norm_eps, arch.softmax_scale
        self.has_q_lora = arch.q_lora_rank is not None
        first = prefix + ("q_a_proj" if self.has_q_lora else "q_proj")
        self.in_proj = Linear.fused(weights, [first, prefix + "kv_a_proj_with_mqa"])
        self.q_split = arch.q_lora_rank or self.num_heads * (self.nope_dim + self.rope_dim)
        if self.has_q_lora:
            self.q_a_norm = weights.pop(prefix + "q_a_layernorm.weight")
            self.q_b_proj = Linear.fused(weights, [prefix + "q_b_proj"])
        self.kv_a_norm = weights.pop(prefix + "kv_a_layernorm.weight")
        kv_b = weights.pop(prefix + "kv_b_proj.weight")
        per_head = kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        self.kv_b_proj = Linear(kv_b, None)  # [H*(nope+v), rank] for the expanded form
        self.w_uk = per_head[:, : self.nope_dim].contiguous()  # [H, nope, rank]
        self.w_uv_t = per_head[:, self.nope_dim :].transpose(1, 2).contiguous()  # [H, rank, v]
        self.o_proj = Linear.fused(weights, [prefix + "o_proj"])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVLayer) -> torch.Tensor:
        num_tokens = x.shape[0]
        projected = self.in_proj(x)
        q = projected[:, : self.q_split]
        if self.has_q_lora:
            q = self.q_b_proj(rms_norm(q, self.q_a_norm, self.eps))
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope = q[..., : self.nope_dim]
        q_pe = apply_rotary(q[..., self.nope_dim :], batch.rope).to(x.dtype)
        latent = rms_norm(projected[:, self.q_split : self.q_split + self.rank], self.kv_a_norm, self.eps)
        k_pe = projected[:, self.q_split + self.rank :].view(num_tokens, 1, self.rope_dim)
        k_pe = apply_rotary(k_pe, batch.rope).to(x.dtype)
        kv.write(batch, torch.cat((latent, k_pe.view(num_tokens, self.rope_dim)), dim=-1))
        if batch.routed is not None:  # absorbed queries against the rows; latent partials merged
            query = self._absorb(q_nope, q_pe).transpose(0, 1)
            out = batch.routed.attend(kv, query, self.split_rows, self.scale)
            return self.o_proj(self._unabsorb(out.transpose(0, 1)))
        if batch.is_decode:
            out = self._decode(q_nope, q_pe, batch, kv)
        else:
            out = torch.cat([self._prefill_one(q_nope, q_pe, span, kv) for span in batch.spans])
        return self.o_proj(out)

    def split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [S, rank + rope] -> keys [S, 1, rank + rope], values [S, 1, rank] (absorbed form)."""
        return rows[:, None], rows[:, None, : self.rank]

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[T, H, nope], [T, H, rope] -> absorbed queries [H, T, rank + rope]."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk)
        return torch.cat((q_latent, q_pe.transpose(0, 1)), dim=-1)

    def _unabsorb(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[H, T, rank] -> [T, H * v]."""
        return torch.bmm(out_latent, self.w_uv_t).transpose(0, 1).reshape(out_latent.shape[1], -1)

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch, kv: KVLayer
    ) -> torch.Tensor:
        assert batch.key_bias is not None
        query = self._absorb(q_nope, q_pe).transpose(0, 1)  # [B, H, rank + rope]
        rows = kv.padded_contexts(batch)  # [B, S, rank + rope]: one key/value head shared by all heads
        bias = batch.key_bias.view(rows.shape[0], 1, rows.shape[1])
        scores = torch.baddbmm(bias, query, rows.transpose(1, 2), alpha=self.scale)
        out = torch.bmm(_softmax(scores), rows[..., : self.rank])  # [B, H, rank]
        return self._unabsorb(out.transpose(0, 1))

    def _absorbed_attention(self, query: torch.Tensor, context: torch.Tensor, span: SeqSpan) -> torch.Tensor:
        """query [H, n, rank + rope] against one sequence's rows [ctx, rank + rope] -> [H, n, rank]; heads
        in chunks so the score matrix stays under SCORE_ELEMENTS."""
        bias = torch.zeros(span.num_new, span.context_len, device=query.device, dtype=query.dtype)
        bias.masked_fill_(~_causal_mask(span, query.device), float("-inf"))
        heads_per_chunk = max(1, SCORE_ELEMENTS // (span.num_new * span.context_len))
        outs = []
        for head in range(0, self.num_heads, heads_per_chunk):
            chunk = query[head : head + heads_per_chunk]
            scores = torch.baddbmm(
                bias.expand(chunk.shape[0], -1, -1),
                chunk,
                context.T.expand(chunk.shape[0], -1, -1),
                alpha=self.scale,
            )
            outs.append(torch.matmul(_softmax(scores), context[:, : self.rank]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _is_absorbed_cheaper(self, span: SeqSpan) -> bool:
        if self.prefill_mode != "auto":
            return self.prefill_mode == "absorbed"
        n, ctx, r = span.num_new, span.context_len, self.rank
        expanded = ctx * r * (self.nope_dim + self.v_dim) + n * ctx * (
            self.nope_dim + self.rope_dim + self.v_dim
        )
        absorbed = n * r * (self.nope_dim + self.v_dim) + n * ctx * (2 * r + self.rope_dim)
        return absorbed < expanded

    def _prefill_one(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, span: SeqSpan, kv: KVLayer
    ) -> torch.Tensor:
        rows = slice(span.start, span.start + span.num_new)
        context = kv.context(span)  # [ctx, rank + rope]
        if self._is_absorbed_cheaper(span):
            return self._unabsorb(
                self._absorbed_attention(self._absorb(q_nope[rows], q_pe[rows]), context, span)
            )
        mask = None if span.num_cached == 0 else _causal_mask(span, q_nope.device)
        causal = {"is_causal": True} if mask is None else {"attn_mask": mask}
        expanded = self.kv_b_proj(context[:, : self.rank]).view(
            span.context_len, self.num_heads, self.nope_dim + self.v_dim
        )
        k_pe = context[:, None, self.rank :].expand(-1, self.num_heads, -1)
        keys = torch.cat((expanded[..., : self.nope_dim], k_pe), dim=-1)
        query = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
        values = expanded[..., self.nope_dim :]
        out = _sdpa(
            query.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            self.scale,
            **causal,
        )
        return out[0].transpose(0, 1).reshape(span.num_new, -1)

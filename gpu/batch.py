"""The per-forward layout every layer shares: flattened tokens, positions, RoPE rows, cache slots, masks.

Built once per prefill/decode call on the host with NumPy (no per-token Python work) and moved to the device
in a few transfers; layers only index into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu.rope import RotaryTable
from shared.errors import ContextLengthExceededError, InvalidRequestError


@dataclass(slots=True)
class SeqSpan:
    """One sequence's new tokens inside a prefill batch."""

    start: int  # first row of its new tokens in the flattened batch
    num_new: int
    num_cached: int
    block_table: torch.Tensor  # [num_blocks covering the context] long, on the device

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new


@dataclass(slots=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    rope: torch.Tensor  # [T, rope_dim/2] complex rotation per token
    slot_rows: torch.Tensor  # [layers, T] row of each new token's KV in the flat cache view, per layer
    logit_rows: torch.Tensor  # rows whose logits are wanted
    is_decode: bool
    spans: list[SeqSpan] = field(default_factory=list)  # prefill
    context_blocks: torch.Tensor | None = None  # decode: [layers, B * max_blocks] Layer Block indices
    context_out: torch.Tensor | None = (
        None  # decode: scratch [B * max_blocks, block_size, kv_dim] for gathers
    )
    key_bias: torch.Tensor | None = None  # decode: [B, 1, 1, longest context], 0 or -inf (padding)
    routed: Any = None  # gpu.partial_attention_routed.RoutedBatch: some context is held elsewhere

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    num_layers: int
    block_size: int
    num_blocks: int
    vocab_size: int
    max_model_len: int


def _slot_rows(geom: CacheGeometry, block_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    blocks = block_ids[positions // geom.block_size]
    return (blocks * geom.num_layers) * geom.block_size + positions % geom.block_size


def _check_seq(
    geom: CacheGeometry, block_ids: Sequence[int], context_len: int, token_ids: Sequence[int]
) -> None:
    if context_len > geom.max_model_len:
        raise ContextLengthExceededError(
            f"context of {context_len} tokens exceeds the model's limit of {geom.max_model_len}"
        )
    if len(block_ids) * geom.block_size < context_len:
        raise InvalidRequestError(
            f"{len(block_ids)} blocks of {geom.block_size} cannot hold a context of {context_len} tokens"
        )
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= geom.vocab_size):
        raise InvalidRequestError(f"token id out of range 0..{geom.vocab_size - 1}")


def build_prefill_batch(
    geom: CacheGeometry,
    rotary: RotaryTable,
    seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    *,
    all_logits: bool,
    device: torch.device,
) -> ForwardBatch:
    """`seqs`: (block_ids, num_cached_tokens, new token_ids) per sequence, each with >= 1 new token."""
    tokens, positions, rows, spans, last_rows = [], [], [], [], []
    start = 0
    for block_ids, num_cached, token_ids in seqs:
        num_new = len(token_ids)
        if num_new == 0:
            raise InvalidRequestError("prefill needs at least one new token per sequence")
        _check_seq(geom, block_ids, num_cached + num_new, token_ids)
        num_blocks = -(-(num_cached + num_new) // geom.block_size)
        ids = np.asarray(block_ids[:num_blocks], dtype=np.int64)
        pos = np.arange(num_cached, num_cached + num_new, dtype=np.int64)
        tokens.append(np.asarray(token_ids, dtype=np.int64))
        positions.append(pos)
        rows.append(_slot_rows(geom, ids, pos))
        spans.append(SeqSpan(start, num_new, num_cached, torch.from_numpy(ids).to(device)))
        start += num_new
        last_rows.append(start - 1)
    pos_all = np.concatenate(positions)
    return _finish(
        geom,
        rotary,
        device,
        token_ids=np.concatenate(tokens),
        positions=pos_all,
        slot_rows=np.concatenate(rows),
        logit_rows=np.arange(start, dtype=np.int64) if all_logits else np.asarray(last_rows, dtype=np.int64),
        spans=spans,
    )


def build_decode_batch(
    geom: CacheGeometry,
    rotary: RotaryTable,
    seqs: Sequence[tuple[Sequence[int], int, int]],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> ForwardBatch:
    """`seqs`: (block_ids, num_cached_tokens, token_id); the token sits at position num_cached_tokens."""
    batch_size = len(seqs)
    positions = np.fromiter((num_cached for _, num_cached, _ in seqs), dtype=np.int64, count=batch_size)
    token_ids = np.fromiter((token for _, _, token in seqs), dtype=np.int64, count=batch_size)
    num_blocks = np.fromiter((len(block_ids) for block_ids, _, _ in seqs), dtype=np.int64, count=batch_size)
    used = positions // geom.block_size + 1
    _check_decode(geom, positions, token_ids, num_blocks)
    max_blocks = int(used.max())
    tables = np.zeros((batch_size, max_blocks), dtype=np.int64)  # padding points at block 0, masked out
    for i, (block_ids, _, _) in enumerate(seqs):
        tables[i, : used[i]] = block_ids[: used[i]]
    blocks = tables[np.arange(batch_size), positions // geom.block_size]
    rows = (blocks * geom.num_layers) * geom.block_size + positions % geom.block_size
    key_positions = np.arange(int(positions.max()) + 1)  # attention stops at the longest context
    bias = np.where(key_positions[None, :] <= positions[:, None], 0.0, -np.inf).astype(np.float32)
    batch = _finish(
        geom,
        rotary,
        device,
        token_ids=token_ids,
        positions=positions,
        slot_rows=rows,
        logit_rows=np.arange(batch_size, dtype=np.int64),
        spans=[],
    )
    batch.is_decode = True
    layers = np.arange(geom.num_layers)[:, None]
    batch.context_blocks = torch.from_numpy(tables.reshape(1, -1) * geom.num_layers + layers).to(device)
    batch.key_bias = torch.from_numpy(bias[:, None, None, :]).to(device=device, dtype=dtype)
    return batch


def _check_decode(
    geom: CacheGeometry, positions: np.ndarray, tokens: np.ndarray, num_blocks: np.ndarray
) -> None:
    if positions.size == 0:
        raise InvalidRequestError("decode of an empty batch")
    if int(positions.max()) >= geom.max_model_len:
        raise ContextLengthExceededError(
            f"context of {int(positions.max()) + 1} tokens exceeds the model's limit of {geom.max_model_len}"
        )
    short = np.flatnonzero(num_blocks * geom.block_size <= positions)
    if short.size:
        i = int(short[0])
        raise InvalidRequestError(
            f"{num_blocks[i]} blocks of {geom.block_size} cannot hold a context of {positions[i] + 1} tokens"
        )
    if int(tokens.min()) < 0 or int(tokens.max()) >= geom.vocab_size:
        raise InvalidRequestError(f"token id out of range 0..{geom.vocab_size - 1}")


def _finish(
    geom: CacheGeometry,
    rotary: RotaryTable,
    device: torch.device,
    *,
    token_ids: np.ndarray,
    positions: np.ndarray,
    slot_rows: np.ndarray,
    logit_rows: np.ndarray,
    spans: list[SeqSpan],
) -> ForwardBatch:
    layer_offsets = np.arange(geom.num_layers)[:, None] * geom.block_size
    host = torch.from_numpy(
        np.concatenate((token_ids[None], positions[None], slot_rows[None] + layer_offsets))
    )
    token_t, pos_t = host[:2].to(device).unbind(0)
    rows_t = host[2:].to(device)
    rope = rotary.lookup(pos_t, int(positions.max()))
    return ForwardBatch(
        token_ids=token_t,
        positions=pos_t,
        rope=rope,
        slot_rows=rows_t,
        logit_rows=torch.from_numpy(logit_rows).to(device),
        is_decode=False,
        spans=spans,
    )

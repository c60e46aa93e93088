"""Rotary position embeddings: inverse frequencies (default, linear, yarn, llama3) and a cos/sin table.

The table is computed in fp32 exactly as transformers does (position * inv_freq, then cos/sin scaled by the
yarn attention factor) and grows by doubling when a longer position shows up.
"""

from __future__ import annotations

import math

import torch

from gpu.arch_config import RopeConfig, yarn_mscale


def inv_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention factor applied to cos and sin)."""
    exponent = torch.arange(0, rope.dim, 2, dtype=torch.int64).to(torch.float32) / rope.dim
    base_freq = rope.theta**exponent
    inv_freq = 1.0 / base_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, base_freq)
    return inv_freq, 1.0


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, base_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    factor, dim = rope.factor, rope.dim
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        length = rope.original_max_position_embeddings
        return (dim * math.log(length / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * base_freq)) * (1 - extrapolation) + (1.0 / base_freq) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryTable:
    """Rotation per position as complex numbers cos + i sin (times the yarn attention factor),
    [num_positions, dim/2] complex64 on the model's device."""

    def __init__(self, rope: RopeConfig, *, device: torch.device, initial_len: int = 4096) -> None:
        self.rope = rope
        self.inv_freq, self.attention_factor = inv_frequencies(rope)
        self.device = device
        self.freqs = torch.empty(0, dtype=torch.complex64, device=device)
        self._build(initial_len)

    def _build(self, length: int) -> None:
        positions = torch.arange(length, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        self.freqs = torch.complex(cos, sin).to(self.device)

    def lookup(self, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """Rows for `positions` (a device tensor); `max_position` is its largest value."""
        if max_position >= self.freqs.shape[0]:
            self._build(max(2 * self.freqs.shape[0], max_position + 1))
        return self.freqs[positions]


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [tokens, heads, dim] whose dims are (re, im) pairs by per-token `freqs` [tokens, dim/2];
    returns a new tensor. Computed in fp32 (one complex multiply), as DeepSeek does."""
    if x.dtype != torch.float32 or x.storage_offset() % 2:
        x = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous()
    rotated = torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs[:, None, :]
    return torch.view_as_real(rotated).flatten(-2)


def interleave_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's output rows from (first half, second half) to (x0, x_half, x1, x_half+1, ...).

    Llama/Qwen2 rotate dim i with dim i + d/2; after this permutation of q_proj/k_proj rows those pairs are
    adjacent, so the same complex-multiply RoPE applies. q.k is unchanged (both get the same permutation);
    only the order of K's dims inside our own cache rows differs from transformers'."""
    head_dim = weight.shape[0] // num_heads
    half = head_dim // 2
    order = torch.stack((torch.arange(half), torch.arange(half, head_dim)), dim=-1).flatten()
    index = (torch.arange(num_heads)[:, None] * head_dim + order[None, :]).flatten().to(weight.device)
    return weight.index_select(0, index)

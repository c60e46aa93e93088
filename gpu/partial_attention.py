"""Partial attention and its exact merge: attention over part of the keys as (o, m, l), combined by LSE.

For query rows and a set of keys, a `Partial` holds, per row and head, in fp32: `o` the unnormalised output
(sum of exp(s - m) v), `m` the largest logit and `l` the softmax denominator (sum of exp(s - m)). Partials
over disjoint key sets merge exactly (online softmax, FlashAttention's carry between tiles, here between
engines): m = max m_j, o = sum exp(m_j - m) o_j, l = sum exp(m_j - m) l_j, and o / l is attention over the
union. An empty partial (no key: m = -inf, l = 0, o = 0) is the identity of the merge; merging only empty
partials stays empty (no NaN).

Shapes: a query is [T, H, dk] (T tokens, H heads); keys [S, G, dk] and values [S, G, dv] with H a multiple of
G (GQA: head h reads key head h // (H / G)). Absorbed MLA is the case G = 1: the cache rows
[latent ; rope key] are the keys and their latent part the values, and the partial's o is a latent output
(W_UV and W_O are linear, so merging before them is exact).

The same partial has many forms: (o, m, l) and (o e^d, m - d, l e^d) finalize and merge alike for any shift d.
`attend` runs one of torch's fused attention kernels, which return the normalised output and each row's
log-sum-exp, so m is the log-sum-exp and l = 1: on a CPU the flash kernel (2-2.6x faster than scores chunk by
chunk at 64-2,048 rows over 256-8,192 keys on this 2-core host, its cost linear in rows x keys: README, "Move
the query"), on a CUDA device the memory-efficient one for calls with many rows and no mask
(`_cuda_fused_pays`). Otherwise it computes scores chunk by chunk and m is the largest logit.

On the wire a partial is packed as one fp32 array [T, H, dv + 2] = (o, m, l) per row: one put per reply.
`PrefixAttention` is the seam the runner calls when a sequence's leading context is not in its cache
(`gpu/partial_attention_routed.py` runs it inside the forward).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SCORE_ELEMENTS = 1 << 20  # on a GPU: bound on one [groups, rows, keys] fp32 score chunk (4 MiB)
MASK_ELEMENTS = 1 << 22  # on a CPU: bound on one additive mask block [rows x heads per group, keys] (16 MiB)

# cache rows [S, kv_dim] of one layer -> (keys [S, G, dk], values [S, G, dv]) in the model's layout
KvSplit = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class Partial:
    """Attention of T query rows x H heads over part of the keys (fp32)."""

    o: torch.Tensor  # [T, H, dv] unnormalised output
    m: torch.Tensor  # [T, H] reference logit: the max logit, or the log-sum-exp (-inf: no key)
    l: torch.Tensor  # noqa: E741 (the paper's name) [T, H] softmax denominator at m (1 at the log-sum-exp)

    @property
    def num_rows(self) -> int:
        return int(self.o.shape[0])


def empty_partial(num_rows: int, num_heads: int, value_dim: int, device: torch.device | str) -> Partial:
    """The merge's identity: attention over no key."""
    return Partial(
        o=torch.zeros(num_rows, num_heads, value_dim, device=device),
        m=torch.full((num_rows, num_heads), float("-inf"), device=device),
        l=torch.zeros(num_rows, num_heads, device=device),
    )


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    *,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
) -> Partial:
    """The partial of `query` [T, H, dk] over `keys` [S, G, dk] / `values` [S, G, dv], computed in fp32.

    With positions given, key t is visible to query row i only when key_positions[t] <= query_positions[i]
    (causal masking that holds across any split of the keys)."""
    num_rows, num_heads, _ = query.shape
    num_keys, groups, value_dim = values.shape
    if num_keys == 0 or num_rows == 0:
        return empty_partial(num_rows, num_heads, value_dim, query.device)
    per_group = num_heads // groups
    assert per_group * groups == num_heads, f"{num_heads} heads over {groups} key heads"
    visible = None
    if query_positions is not None and key_positions is not None:
        visible = key_positions[None, :] <= query_positions[:, None]  # [T, S]
    if query.device.type == "cpu":
        return _attend_fused(query, keys, values, scale, visible, _cpu_kernel)
    if query.device.type == "cuda" and _cuda_fused_pays(query, values, visible):
        return _attend_fused(query, keys, values, scale, None, _cuda_kernel)
    return _attend_chunked(query, keys, values, scale, visible)


def _attend_chunked(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, visible: torch.Tensor | None
) -> Partial:
    """`attend` in row chunks whose [G, rows, r, S] scores stay under SCORE_ELEMENTS; m is the max logit."""
    num_rows, num_heads, key_dim = query.shape
    num_keys, groups, _ = values.shape
    per_group = num_heads // groups
    q = query.float().reshape(num_rows, groups, per_group, key_dim).permute(1, 0, 2, 3)
    k = keys.float().transpose(0, 1)  # [G, S, dk]
    v = values.float().transpose(0, 1)  # [G, S, dv]
    rows_per_chunk = max(1, SCORE_ELEMENTS // (groups * per_group * num_keys))
    parts = []
    for start in range(0, num_rows, rows_per_chunk):
        end = min(num_rows, start + rows_per_chunk)
        mask = None if visible is None else visible[start:end]
        parts.append(_attend_rows(q[:, start:end], k, v, scale, mask))
    o, m, denom = (torch.cat(x, dim=0) if len(parts) > 1 else x[0] for x in zip(*parts, strict=True))
    return Partial(o=o, m=m, l=denom)


# (q, k, v [1, G, rows | keys, width] fp32, additive mask [1, 1, rows, keys] | None, scale) ->
# (normalised output [1, G, rows, width], log-sum-exp [1, G, rows])
FusedKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], tuple[torch.Tensor, torch.Tensor]
]
_CUDA_MAX_WIDTH = 1024  # head sizes the memory-efficient CUDA kernel is used for (absorbed MLA: 576)
_CUDA_MIN_ROW_HEADS = 2048  # query rows x heads from which that kernel beats chunked scores (README, "GPU")


def _cpu_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(q, k, v, scale=scale, attn_mask=mask)
    return out, lse


def _cuda_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's memory-efficient CUDA kernel: fp32 in and out, the log-sum-exp per row (padded to a multiple
    of 32 rows). Never given a mask (`_cuda_fused_pays`)."""
    assert mask is None
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, False, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _cuda_fused_pays(query: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None) -> bool:
    """Measured on an H200 (README, "GPU"): the fused kernel gives a CTA to a tile of (row x head) rows and
    walks every key in it, so a few rows leave the device idle (1 row over 8,192 keys: 0.8 ms against
    chunked scores' 0.26; absorbed MLA, 64 rows x 16 heads: 2.7 against 1.6 ms) while from ~2,048 row-heads
    up it is 3-27x faster. A mask would be an fp32 bias per (row x head, key), up to 0.5 GB at 512 x 8 x
    32,768 and slower than the scores (0.15-0.9x): masked calls stay chunked. A holder's chunk precedes
    every routed row, so its calls carry no mask."""
    width = max(query.shape[-1], values.shape[-1])
    big = query.shape[0] * query.shape[1] >= _CUDA_MIN_ROW_HEADS
    return big and width <= _CUDA_MAX_WIDTH and width % 4 == 0 and (visible is None or bool(visible.all()))


def _attend_fused(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,
    kernel: FusedKernel,
) -> Partial:
    """`attend` through one of torch's fused kernels, which return (normalised output, log-sum-exp): the
    partial (o, lse, 1). The heads of a key group share its keys, so they are folded into rows
    ([1, G, T x r, d]) and the keys are read in place; one head size for both products, so the shorter of dk
    and dv is zero-padded (absorbed MLA's values). A mask, where some key is hidden from some row, goes in
    additive blocks."""
    num_rows, num_heads, key_dim = query.shape
    num_keys, groups, value_dim = values.shape
    per_group = num_heads // groups
    width = max(key_dim, value_dim)
    q = query.float().reshape(num_rows, groups, per_group, key_dim).transpose(0, 1)
    q = _pad(q.reshape(1, groups, num_rows * per_group, key_dim), width)
    k = _pad(keys.float().transpose(0, 1)[None], width)
    if _leads(values, keys):  # absorbed MLA: the values are the keys' first dv columns, read in place
        v = k
    else:
        v = _pad(values.float().transpose(0, 1)[None], width)
    if visible is None or bool(visible.all()):
        out, lse = kernel(q, k, v, None, scale)
    else:
        step = max(1, MASK_ELEMENTS // (per_group * num_keys))
        outs, lses = [], []
        for start in range(0, num_rows, step):
            block = visible[start : start + step]
            mask = torch.zeros(block.shape).masked_fill_(~block, float("-inf"))
            rows = slice(start * per_group, (start + block.shape[0]) * per_group)
            mask = mask.repeat_interleave(per_group, 0)[None, None]
            o_b, lse_b = kernel(q[:, :, rows], k, v, mask, scale)
            outs.append(o_b)
            lses.append(lse_b)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    o = out[0, :, :, :value_dim].reshape(groups, num_rows, per_group, value_dim).transpose(0, 1)
    m = lse[0].reshape(groups, num_rows, per_group).transpose(0, 1).reshape(num_rows, num_heads)
    partial = Partial(o=o.reshape(num_rows, num_heads, value_dim), m=m, l=torch.ones_like(m))
    if visible is not None:
        empty = ~visible.any(dim=1)  # a row that sees no key (the kernels give lse 0 or -inf, o 0 or NaN)
        partial.m.masked_fill_(empty[:, None], float("-inf"))
        partial.l.masked_fill_(empty[:, None], 0.0)
        partial.o.masked_fill_(empty[:, None, None], 0.0)
    return partial


def _leads(values: torch.Tensor, keys: torch.Tensor) -> bool:
    """`values` is a view of the leading columns of `keys` (keys[..., :dv])."""
    return (
        values.data_ptr() == keys.data_ptr()
        and values.stride() == keys.stride()
        and values.shape[:-1] == keys.shape[:-1]
    )


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [G, t, r, dk] against k [G, S, dk], v [G, S, dv] -> o [t, G*r, dv], m and l [t, G*r]."""
    groups, rows, per_group, key_dim = q.shape
    scores = torch.bmm(q.reshape(groups, rows * per_group, key_dim), k.transpose(1, 2)).mul_(scale)
    scores = scores.view(groups, rows, per_group, -1)
    if mask is not None:
        scores.masked_fill_(~mask[None, :, None, :], float("-inf"))
    m = scores.amax(dim=-1)  # [G, t, r]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row with no visible key stays empty
    weights = torch.exp(scores.sub_(m_safe[..., None]))
    denom = weights.sum(dim=-1)
    o = torch.bmm(weights.view(groups, rows * per_group, -1), v).view(groups, rows, per_group, -1)
    return (
        o.permute(1, 0, 2, 3).reshape(rows, groups * per_group, -1),
        m.permute(1, 0, 2).reshape(rows, -1),
        denom.permute(1, 0, 2).reshape(rows, -1),
    )


def merge(partials: Sequence[Partial]) -> Partial:
    """Exact combination of partials over disjoint key sets (any order, any grouping)."""
    if len(partials) == 1:
        return partials[0]
    m = torch.stack([p.m for p in partials]).amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    o = torch.zeros_like(partials[0].o)
    denom = torch.zeros_like(partials[0].l)
    for p in partials:
        weight = torch.exp(p.m - m_safe)  # 0 for an empty partial (m = -inf)
        denom += weight * p.l
        o += weight[..., None] * p.o
    return Partial(o=o, m=m, l=denom)


def finalize(partial: Partial) -> torch.Tensor:
    """Attention output o / l [T, H, dv] (fp32); rows with no visible key give 0."""
    return partial.o / partial.l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]


def pack(partial: Partial) -> torch.Tensor:
    """The wire form: fp32 [T, H, dv + 2] = (o, m, l) per row and head, contiguous."""
    return torch.cat((partial.o, partial.m[..., None], partial.l[..., None]), dim=-1)


def unpack(packed: torch.Tensor) -> Partial:
    """Views into a packed [T, H, dv + 2] fp32 array (no copy)."""
    return Partial(o=packed[..., :-2], m=packed[..., -2], l=packed[..., -1])


class PrefixAttention(abc.ABC):
    """Attention over a sequence's leading context that is not in the paged cache: a chunk held by another
    engine (route), or a local copy of it (after a fetch or a recompute).

    The runner calls it from its worker thread, once per layer of every forward the sequence is in, in layer
    order: `begin` with the layer's query rows (it may queue a network exchange and return at once), `flush`
    once every sequence of the forward began the layer (queued exchanges go out together), then, after the
    local attention ran, `end` for their partial. `end` may block (waiting for a reply) but must return or
    raise within its own deadline; it never sees another sequence's rows."""

    num_tokens: int  # leading positions [0, num_tokens) it covers; the cache holds the rest

    @abc.abstractmethod
    def begin(self, layer: int, query: torch.Tensor, split: KvSplit, scale: float) -> None:
        """Query rows [T, H, dk] of this layer (their positions are all >= num_tokens)."""

    @abc.abstractmethod
    def end(self, layer: int) -> Partial:
        """The partial of the rows given to `begin(layer, ...)` over positions [0, num_tokens)."""

    def flush(self) -> None:  # noqa: B027 (a hook: only a prefix held elsewhere queues anything)
        """Start what `begin` queued (nothing to do for a prefix computed here)."""


class LocalPrefix(PrefixAttention):
    """The prefix's KV held here as one tensor [layers, num_tokens, kv_dim] (cache-row layout)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.num_tokens = int(rows.shape[1])
        self._pending: dict[int, Partial] = {}

    def begin(self, layer: int, query: torch.Tensor, split: KvSplit, scale: float) -> None:
        keys, values = split(self.rows[layer])
        self._pending[layer] = attend(query, keys, values, scale)

    def end(self, layer: int) -> Partial:
        return self._pending.pop(layer)

"""The compute halves of `kvpath bench movequery` (torch lives in gpu/): the holder's partial attention over
a chunk, the requester's merge, the splice of fetched KV into a paged cache, a chunk's local prefill, and
the exactness of the LSE merge. Bytes in, bytes out: the bench moves them over the real data plane."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.partial_attention import attend, finalize, merge, pack, unpack
from gpu.partial_attention_remote import compute_prefix_rows, query_dim


@dataclass(slots=True)
class BenchShape:
    """One layer of the served model as the route wire sees it."""

    num_layers: int
    num_heads: int
    key_heads: int
    key_dim: int  # dk: a query row's values (GQA head_dim, absorbed MLA rank + rope)
    value_dim: int
    kv_bytes_per_token_layer: int
    dtype: torch.dtype

    @property
    def query_bytes_per_row(self) -> int:
        return self.key_dim * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def partial_bytes_per_row(self) -> int:
        return (self.value_dim + 2) * 4


def bench_shape(runner: Any) -> BenchShape:
    arch, kv = runner.arch, runner.kv
    is_mla = arch.attention == "mla"
    return BenchShape(
        num_layers=int(arch.num_layers),
        num_heads=int(arch.num_heads),
        key_heads=1 if is_mla else int(arch.num_kv_heads),
        key_dim=query_dim(runner.model),
        value_dim=int(arch.kv_lora_rank if is_mla else arch.head_dim),
        kv_bytes_per_token_layer=int(kv.bytes_per_token_layer),
        dtype=kv.tensor.dtype,
    )


class HolderKernel:
    """A chunk of `num_tokens` random keys/values, answering query bytes with packed (o, m, l) bytes."""

    def __init__(self, shape: BenchShape, num_tokens: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.shape = shape
        self.keys = torch.randn(num_tokens, shape.key_heads, shape.key_dim, generator=gen).to(shape.dtype)
        self.values = torch.randn(num_tokens, shape.key_heads, shape.value_dim, generator=gen).to(shape.dtype)
        self.scale = shape.key_dim**-0.5

    def answer(self, query: np.ndarray, num_tokens: int) -> np.ndarray:
        rows = torch.from_numpy(query).view(self.shape.dtype).view(num_tokens, self.shape.num_heads, -1)
        return pack(attend(rows, self.keys, self.values, self.scale)).numpy().reshape(-1)


def random_query(shape: BenchShape, num_tokens: int, seed: int = 1) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_tokens, shape.num_heads, shape.key_dim, generator=gen).to(shape.dtype)
    return rows.view(torch.uint8).numpy().reshape(-1)


class Merger:
    """The requester's side of one exchange: its local partial (over a short suffix) merged with the reply."""

    def __init__(self, shape: BenchShape, num_tokens: int, suffix_tokens: int = 64) -> None:
        self.shape = shape
        kernel = HolderKernel(shape, suffix_tokens, seed=7)
        query = torch.from_numpy(random_query(shape, num_tokens)).view(shape.dtype)
        rows = query.view(num_tokens, shape.num_heads, -1)
        self.local = attend(rows, kernel.keys, kernel.values, kernel.scale)
        self.num_tokens = num_tokens

    def merge(self, reply: np.ndarray) -> None:
        packed = torch.from_numpy(reply).view(self.num_tokens, self.shape.num_heads, -1)
        finalize(merge([unpack(packed), self.local]))


class Splicer:
    """Fetched Full Blocks [n, layers, block_size, kv_dim] into a paged cache (one scatter, every layer)."""

    def __init__(self, shape: BenchShape, num_tokens: int, block_size: int) -> None:
        self.num_blocks = -(-num_tokens // block_size)
        kv_dim = shape.kv_bytes_per_token_layer // torch.empty(0, dtype=shape.dtype).element_size()
        self.cache = torch.zeros(self.num_blocks * 2, shape.num_layers, block_size, kv_dim, dtype=shape.dtype)
        self.ids = torch.arange(self.num_blocks, 2 * self.num_blocks)

    def splice(self, data: np.ndarray) -> None:
        blocks = torch.from_numpy(data).view(self.cache.dtype).view(self.num_blocks, *self.cache.shape[1:])
        self.cache.index_copy_(0, self.ids, blocks)


def local_prefill_s(runner: Any, num_tokens: int, repeats: int = 2) -> float:
    """Best time to recompute a chunk's KV from its tokens (the `local` primitive)."""
    tokens = [(i * 37 + 5) % 200 + 3 for i in range(num_tokens)]
    geometry = runner._geometry  # the runner's own cache geometry (max_model_len, vocab)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            compute_prefix_rows(runner.model, tokens, geometry)
            best = min(best, time.perf_counter() - started)
    return best


def merge_max_rel_err(num_splits: int = 8, seed: int = 0) -> float:
    """Largest error (`round_off_error`) of merged partials vs unsplit attention (fp32), absorbed MLA decode
    shape (16 heads x 576 / 512, 2048 keys) and a GQA prefill shape, random contiguous splits into
    num_splits."""
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for heads, groups, dk, dv, keys, rows in ((16, 1, 576, 512, 2048, 4), (8, 2, 64, 64, 1500, 96)):
        query = torch.randn(rows, heads, dk, generator=gen)
        k, v = torch.randn(keys, groups, dk, generator=gen), torch.randn(keys, groups, dv, generator=gen)
        scale = dk**-0.5
        whole = finalize(attend(query, k, v, scale))
        cuts = sorted(torch.randint(0, keys + 1, (num_splits - 1,), generator=gen).tolist())
        edges = [0, *cuts, keys]
        parts = [attend(query, k[a:b], v[a:b], scale) for a, b in itertools.pairwise(edges)]
        worst = max(worst, round_off_error(finalize(merge(parts)), whole, v))
    return worst


def round_off_error(got: torch.Tensor, want: torch.Tensor, values: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest |value|: fp32 round-off of a softmax-weighted sum of
    values grows with the values summed, not with the output, which on random data is an average of them
    near 0 (relative to the largest output, two fp32 orders of the same sum differ by up to ~2e-6)."""
    return float((got.double() - want.double()).abs().max() / values.double().abs().max())

"""Both ends of a routed prefix as the model runtime sees them: bytes in, partials out, no transport here.

Requester: the engine implements `ChunkExchange` (bytes only: services never import torch) and puts it in
`PrefillSeq.prefix` / `DecodeSeq.prefix`; the runner wraps it in `ExchangedPrefix`, which sends each layer's
query rows through it and turns the packed reply into a `Partial`. When the exchange gives up (the holder
died, missed its deadline or answered garbage) the prefix falls back, inside the same step and without
touching the sequence's cache: the engine returns the chunk's KV (fetched from the store) or its token ids
(recomputed here into a private tensor), and from then on the prefix's partial is computed locally, so the
sequence's tokens are the ones it would have produced anyway.

Holder: `held_partials` answers many requesters' queries against pinned chunks, one attention call per
(chunk, layer) for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from gpu.batch import CacheGeometry, build_prefill_batch
from gpu.partial_attention import (
    KvSplit,
    LocalPrefix,
    Partial,
    PrefixAttention,
    attend,
    pack,
    unpack,
)

# the chunk's token ids -> its KV rows [layers, tokens, kv_dim] (computed in the runner's worker thread)
Recompute = Callable[[Sequence[int]], torch.Tensor]


class ChunkExchange(Protocol):
    """The engine's side of a routed prefix. Called from the runner's worker thread, in layer order."""

    num_tokens: int  # the chunk's length: positions [0, num_tokens) of the sequence
    fallback_state: Any  # what the runtime keeps after a fallback (the engine stores it, drops it on release)

    def send(self, layer: int, query: memoryview) -> None:
        """Queue or ship this layer's query rows (bytes of [T, H, dk] in the cache dtype); must not block."""

    def flush(self) -> None:
        """Ship what `send` queued: called once every sequence of the forward sent the layer's rows (an
        exchange may carry the rows of several sequences); must not block."""

    def receive(self, layer: int) -> np.ndarray | None:
        """The reply to `send(layer)`: float32 (o, m, l) rows, T * H * (dv + 2) values; None when the route
        failed or missed its deadline (the prefix then falls back). Blocks at most the route's deadline."""

    def fallback(self) -> np.ndarray | Sequence[int]:
        """The chunk's KV as Full Blocks, uint8 [blocks, layers, block_size, bytes] (fetched), or its token
        ids (to recompute here). Blocks while it fetches."""


class ExchangedPrefix(PrefixAttention):
    def __init__(self, exchange: ChunkExchange, recompute: Recompute, dtype: torch.dtype) -> None:
        self.exchange = exchange
        self.num_tokens = exchange.num_tokens
        self._recompute = recompute
        self._dtype = dtype
        self._query: torch.Tensor | None = None
        self._staged: torch.Tensor | None = None  # the bytes in flight, alive until the reply
        self._split: KvSplit | None = None
        self._scale = 1.0

    def begin(self, layer: int, query: torch.Tensor, split: KvSplit, scale: float) -> None:
        self._query, self._split, self._scale = query, split, scale
        if self.exchange.fallback_state is None:
            staged = query.contiguous().cpu()  # the bytes on the wire (a copy: the rows are strided)
            self._staged = staged
            self.exchange.send(layer, memoryview(staged.view(torch.uint8).numpy()).cast("B"))

    def flush(self) -> None:
        if self._staged is not None:
            self.exchange.flush()

    def end(self, layer: int) -> Partial:
        assert self._query is not None and self._split is not None
        query, self._query, self._staged = self._query, None, None
        if self.exchange.fallback_state is None:
            reply = self.exchange.receive(layer)
            partial = _unpack_reply(reply, query) if reply is not None else None
            if partial is not None:
                return partial
            self.exchange.fallback_state = self._local_copy(query.device)
        local: LocalPrefix = self.exchange.fallback_state
        keys, values = self._split(local.rows[layer])
        return attend(query, keys, values, self._scale)

    def _local_copy(self, device: torch.device) -> LocalPrefix:
        source = self.exchange.fallback()
        if isinstance(source, np.ndarray):
            return LocalPrefix(rows_from_full_blocks(source, self.num_tokens, self._dtype, device))
        return LocalPrefix(self._recompute(source))


def _unpack_reply(reply: np.ndarray, query: torch.Tensor) -> Partial | None:
    """The packed reply as a partial on the query's device; None when its size or values are wrong."""
    num_rows, num_heads = query.shape[0], query.shape[1]
    per_head, rest = divmod(reply.size, num_rows * num_heads)
    if rest or per_head < 3 or reply.dtype != np.float32:
        return None
    packed = torch.from_numpy(reply).view(num_rows, num_heads, per_head).to(query.device)
    if not bool(torch.isfinite(packed[..., :-2]).all()) or bool((packed[..., -1] < 0).any()):
        return None  # m may be -inf (no key); o and l never are
    return unpack(packed)


def rows_from_full_blocks(
    full_blocks: np.ndarray, num_tokens: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Full Blocks uint8 [n, layers, block_size, bytes] -> KV rows [layers, num_tokens, kv_dim] (one copy)."""
    blocks = torch.from_numpy(full_blocks).view(dtype)  # [n, L, bs, kv_dim]
    n, layers, block_size, kv_dim = blocks.shape
    rows = blocks.permute(1, 0, 2, 3).reshape(layers, n * block_size, kv_dim)[:, :num_tokens]
    return rows.to(device).contiguous()


def compute_prefix_rows(model: Any, token_ids: Sequence[int], geometry: CacheGeometry) -> torch.Tensor:
    """The KV rows [layers, len(token_ids), kv_dim] of a chunk prefilled from position 0 into a private
    tensor (the engine's cache is not touched). Runs in the worker thread, possibly inside a forward."""
    num_tokens, block_size = len(token_ids), geometry.block_size
    num_blocks = -(-num_tokens // block_size)
    tensor = torch.empty(
        (num_blocks, geometry.num_layers, block_size, int(model.arch.kv_dim)),
        dtype=model.dtype,
        device=model.device,
    )
    geom = CacheGeometry(
        geometry.num_layers, block_size, num_blocks, geometry.vocab_size, geometry.max_model_len
    )
    batch = build_prefill_batch(
        geom,
        model.rotary,
        [(list(range(num_blocks)), 0, list(token_ids))],
        all_logits=False,
        device=model.device,
    )
    hidden = model.embed(batch)
    for index in range(geometry.num_layers):
        hidden = model.layer(index, hidden, batch, tensor)
    rows = tensor.permute(1, 0, 2, 3).reshape(geometry.num_layers, num_blocks * block_size, -1)
    return rows[:, :num_tokens].contiguous()


# ---------------------------------------------------------------------------------------------- holder


@dataclass(slots=True)
class HeldJob:
    """One requester's query rows for one layer, against the first `num_tokens` of a pinned chunk."""

    block_ids: Sequence[int]  # the chunk's cache blocks covering num_tokens
    num_tokens: int
    layer: int
    query: np.ndarray  # uint8 bytes of [T, H, dk] in the cache dtype (a view of the receive region)
    num_query_tokens: int


def held_partials(model: Any, kv_tensor: torch.Tensor, jobs: Sequence[HeldJob]) -> list[np.ndarray | str]:
    """Per job: its packed partial, float32 [T * H * (dv + 2)] (a view, valid until the next call), or why
    it was refused. Jobs against the same chunk range and layer share one attention call."""
    out: list[np.ndarray | str] = [""] * len(jobs)
    groups: dict[tuple[int, int, tuple[int, ...]], list[tuple[int, torch.Tensor]]] = {}
    for i, job in enumerate(jobs):
        query = _query_of(job, model, kv_tensor.dtype)
        if isinstance(query, str):
            out[i] = query
            continue
        key = (job.layer, job.num_tokens, tuple(job.block_ids))
        groups.setdefault(key, []).append((i, query.to(kv_tensor.device)))
    for (layer, num_tokens, block_ids), members in groups.items():
        attention = model.layers[layer].attention
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv_tensor.device)
        rows = kv_tensor[ids, layer].reshape(-1, kv_tensor.shape[-1])[:num_tokens]
        keys, values = attention.split_rows(rows)
        queries = torch.cat([q for _, q in members]) if len(members) > 1 else members[0][1]
        packed = pack(attend(queries, keys, values, attention.scale)).cpu()
        start = 0
        for i, query in members:
            out[i] = packed[start : start + query.shape[0]].numpy().reshape(-1)
            start += query.shape[0]
    return out


def query_dim(model: Any) -> int:
    """Values per query row and head on the wire: GQA head_dim, absorbed MLA kv_lora_rank + rope dim."""
    arch = model.arch
    return int(arch.kv_lora_rank + arch.qk_rope_head_dim if arch.attention == "mla" else arch.head_dim)


def _query_of(job: HeldJob, model: Any, dtype: torch.dtype) -> torch.Tensor | str:
    if not 0 <= job.layer < len(model.layers):
        return f"layer {job.layer} out of range 0..{len(model.layers) - 1}"
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_token = model.arch.num_heads * query_dim(model) * itemsize
    if job.num_query_tokens <= 0 or job.query.size != per_token * job.num_query_tokens:
        return (
            f"{job.query.size} query bytes are not {job.num_query_tokens} tokens x "
            f"{model.arch.num_heads} heads x {query_dim(model)} values of {dtype}"
        )
    query = torch.from_numpy(job.query).view(dtype).view(job.num_query_tokens, model.arch.num_heads, -1)
    if not bool(torch.isfinite(query).all()):
        return "query rows hold NaN or inf"
    return query

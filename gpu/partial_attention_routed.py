"""Attention inside a forward whose batch has sequences with a leading context held elsewhere (`prefix`).

When any sequence of a prefill or decode batch carries a `PrefixAttention`, the runner attaches a
`RoutedBatch` to the `ForwardBatch` and each attention layer hands its queries here instead of to its own
kernels. Per layer: every prefix gets its rows first (`begin`: a routed prefix queues them for its holder),
then `flush` sends them (one exchange per holder for all the batch's sequences routed to it), then each
sequence's local partial is computed over the positions this cache holds (causal across the split), then each
prefix's partial is collected (`end`) and merged exactly. The round trips are in flight while the local
attention of every sequence runs; a layer's queries depend on the previous layer's output, so one sequence's
layers cannot overlap each other.

A routed sequence's block table still covers its whole context (so the scheduler's accounting is unchanged),
but its first `prefix.num_tokens // block_size` entries are placeholders (`PagedKVCache.null_block`) that are
never read or written here. Sequences without a prefix in the same batch are computed by the same partial
path (their local partial is the whole attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu.attention import KVLayer
from gpu.partial_attention import KvSplit, Partial, PrefixAttention, attend, finalize, merge
from shared.errors import InvalidRequestError


@dataclass(slots=True)
class RoutedSeq:
    start: int  # first row of its new tokens in the flattened batch
    num_new: int
    num_cached: int  # positions before its new tokens
    local_start: int  # first position held in this cache (the prefix's length, or 0)
    table: torch.Tensor  # [blocks] ids covering positions [local_start, context_len), long, on the device
    prefix: PrefixAttention | None

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new


class RoutedBatch:
    def __init__(self, seqs: list[RoutedSeq], num_rows: int) -> None:
        self.seqs = seqs
        self.num_rows = num_rows

    @classmethod
    def build(
        cls,
        seqs: Sequence[tuple[Sequence[int], int, int, PrefixAttention | None]],
        *,
        block_size: int,
        device: torch.device,
    ) -> RoutedBatch:
        """`seqs`: (block_ids, num_cached_tokens, num_new_tokens, prefix) in batch row order."""
        out, start = [], 0
        for block_ids, num_cached, num_new, prefix in seqs:
            local_start = 0 if prefix is None else prefix.num_tokens
            if local_start % block_size or local_start > num_cached:
                raise InvalidRequestError(
                    f"a prefix of {local_start} tokens must be whole blocks of {block_size} and precede the "
                    f"{num_cached} cached tokens"
                )
            first, end = local_start // block_size, -(-(num_cached + num_new) // block_size)
            table = torch.as_tensor(list(block_ids[first:end]), dtype=torch.long).to(device)
            out.append(RoutedSeq(start, num_new, num_cached, local_start, table, prefix))
            start += num_new
        return cls(out, start)

    def attend(self, kv: KVLayer, query: torch.Tensor, split: KvSplit, scale: float) -> torch.Tensor:
        """Attention output [T, H, dv] (in the query's dtype) of layer `kv.layer` for the whole batch."""
        layer = kv.layer
        routed = [(s, s.prefix) for s in self.seqs if s.prefix is not None]
        for s, prefix in routed:
            prefix.begin(layer, query[s.start : s.start + s.num_new], split, scale)
        for _, prefix in routed:  # the layer's exchanges go out together, before the local attention
            prefix.flush()
        outputs = []
        for s in self.seqs:
            local = self._local(kv, s, query[s.start : s.start + s.num_new], split, scale)
            if s.prefix is not None:
                local = merge([s.prefix.end(layer), local])
            outputs.append(finalize(local))
        return torch.cat(outputs).to(query.dtype) if len(outputs) > 1 else outputs[0].to(query.dtype)

    @staticmethod
    def _local(kv: KVLayer, s: RoutedSeq, query: torch.Tensor, split: KvSplit, scale: float) -> Partial:
        index = s.table * kv.num_layers + kv.layer
        rows = kv.by_layer_block.index_select(0, index).flatten(0, 1)[: s.context_len - s.local_start]
        keys, values = split(rows)
        if s.num_new == 1:  # one query at the last position sees every key
            return attend(query, keys, values, scale)
        device = query.device
        return attend(
            query,
            keys,
            values,
            scale,
            query_positions=torch.arange(s.num_cached, s.context_len, device=device),
            key_positions=torch.arange(s.local_start, s.context_len, device=device),
        )

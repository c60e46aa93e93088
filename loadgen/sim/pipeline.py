"""Timing of one prefill forward step (pure): the layerwise pipeline, the non-layerwise baseline, and the
compute model that gives a batch its per-layer seconds.

Layerwise (brief 8.1): layer l's KV streams into HBM right after layer l-1's, and layer l computes once its KV
has arrived and layer l-1 is done: start_l = max(done_{l-1}, arrival_l). Non-layerwise (Basic): every layer's
KV is in HBM before the first layer computes. An EP group (a node's PEs, data-parallel attention) steps
together: per layer it waits for the slowest rank's attention and KV, and shares the linear FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.sim.models import SimModel


def layerwise_finish_s(
    start_s: float, num_layers: int, transfer_s_per_layer: float, compute_s_per_layer: float
) -> float:
    """When the last layer is done: KV transfers back to back from `start_s`, compute waits for each."""
    done = start_s
    for layer in range(num_layers):
        arrival = start_s + (layer + 1) * transfer_s_per_layer
        done = max(done, arrival) + compute_s_per_layer
    return done


def non_layerwise_finish_s(
    start_s: float, num_layers: int, transfer_s_per_layer: float, compute_s_per_layer: float
) -> float:
    """All layers' KV first, then all layers' compute (no overlap)."""
    return start_s + num_layers * (transfer_s_per_layer + compute_s_per_layer)


@dataclass(frozen=True, slots=True)
class RankBatch:
    """One PE's part of a step: its (cached, new) token pairs and the KV bytes per layer it loads over each
    path (loopback from its own node's buffer, or streamed from a DE over the compute network)."""

    pairs: tuple[tuple[int, int], ...]
    loopback_bytes_per_layer: float
    network_bytes_per_layer: float


@dataclass(frozen=True, slots=True)
class StepTiming:
    duration_s: float
    compute_s_per_layer: float
    transfer_s_per_layer: float
    attention_s: tuple[float, ...]  # per rank, one layer

    @property
    def attention_balance(self) -> float | None:
        """Max/avg attention time across the ranks (brief 7.11); None unless every rank had work (an idle rank
        in a half-empty cluster says nothing about balance, as the paper leaves out its underloaded tail)."""
        total = sum(self.attention_s)
        if len(self.attention_s) < 2 or min(self.attention_s) <= 0:
            return None
        return max(self.attention_s) * len(self.attention_s) / total


def rank_attention_s(model: SimModel, pairs: Sequence[tuple[int, int]]) -> float:
    return sum(model.attention_layer_flops(c, b) for c, b in pairs) / model.attention_flops_per_s


def step_timing(
    model: SimModel,
    ranks: Sequence[RankBatch],
    *,
    is_layerwise: bool,
    loopback_bytes_per_s: float,
    network_bytes_per_s: float,
) -> StepTiming:
    """Seconds of one step of the group `ranks` (one rank: an engine on its own)."""
    attention = tuple(rank_attention_s(model, r.pairs) for r in ranks)
    new_tokens = sum(b for r in ranks for _, b in r.pairs)
    linear_s = model.linear_layer_flops(new_tokens) / (len(ranks) * model.linear_flops_per_s)
    compute = max(attention) + linear_s
    transfer = max(
        r.loopback_bytes_per_layer / loopback_bytes_per_s + r.network_bytes_per_layer / network_bytes_per_s
        for r in ranks
    )
    finish = layerwise_finish_s if is_layerwise else non_layerwise_finish_s
    duration = finish(0.0, model.num_layers, transfer, compute)
    return StepTiming(duration, compute, transfer, attention)

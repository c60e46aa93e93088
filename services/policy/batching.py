"""Intra-engine PE batching under a compute quota (brief 5.5), with its attention-time profile.

Pure code. The prefill engine calls `plan_prefill_batch` once per forward step with its waiting requests as
(cached, remaining) pairs and runs the returned batch; after the step it may add the measured per-layer
attention time to its samples and refit with `fit_attention_profile`. Attention is data-parallel across GPUs
that synchronize after it, so every PE packs batches of about the same predicted attention time (the quota).

Model: per layer, causal prefill of `bsz` new tokens on top of `cached` tokens with KV costs
4 * H * d * (bsz * cached + bsz * (bsz + 1) / 2) FLOPs (QK^T and PV, 2 * d each per query-key pair per head),
and a batch takes `intercept_s + s_per_flop * sum of FLOPs` seconds. The quota is a per-layer budget (brief
5.5 [INF]: the paper says "attention layer execution time"). Sparse attention (DSA top-k) is not modelled.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from shared.errors import ConfigError, KvpathError

COMPUTE_QUOTA_S = 0.3  # paper 6.2 / A.4: 300 ms per forward batch
# [INF] prior before any measurement: 50 GFLOP/s effective attention throughput (a 2-core CPU with torch),
# no fixed cost. Samples replace it as soon as the engine has measured a few batches.
PRIOR_FLOPS_PER_S = 5e10


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Attention geometry of the model, per layer: query heads and head dimension."""

    num_q_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.num_q_heads < 1 or self.head_dim < 1:
            raise ConfigError(f"attention shape {self.num_q_heads} heads x {self.head_dim}: must be >= 1")


def attention_flops(cached_tokens: int, new_tokens: int, shape: AttentionShape) -> float:
    """FLOPs of one attention layer for `new_tokens` causal queries after `cached_tokens` of context."""
    pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
    return 4.0 * shape.num_q_heads * shape.head_dim * pairs


def batch_attention_flops(pairs: Sequence[tuple[int, int]], shape: AttentionShape) -> float:
    """Sum of `attention_flops` over (cached, bsz) pairs."""
    return sum(attention_flops(cached, bsz, shape) for cached, bsz in pairs)


@dataclass(frozen=True, slots=True)
class AttentionProfile:
    """Seconds of one attention layer as a linear function of its FLOPs (an empty batch costs 0)."""

    s_per_flop: float
    intercept_s: float = 0.0

    def predict_s(self, flops: float) -> float:
        return 0.0 if flops <= 0 else self.intercept_s + self.s_per_flop * flops


PRIOR_PROFILE = AttentionProfile(s_per_flop=1.0 / PRIOR_FLOPS_PER_S, intercept_s=0.0)


@dataclass(frozen=True, slots=True)
class AttentionSample:
    """One measured batch: its (cached, bsz) pairs and the per-layer attention seconds it took."""

    pairs: tuple[tuple[int, int], ...]
    seconds: float


def _fit_line(xs: Sequence[float], ys: Sequence[float], prior: AttentionProfile) -> AttentionProfile:
    """Least squares y = a + b x, kept physical: b > 0 and a >= 0."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var_x = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var_x if var_x else 0.0
    if slope <= 0:  # one distinct size, or noise hides the trend: keep the prior's slope, fit the offset
        offset = max(0.0, statistics.fmean(y - prior.s_per_flop * x for x, y in zip(xs, ys, strict=True)))
        return AttentionProfile(s_per_flop=prior.s_per_flop, intercept_s=offset)
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # refit through the origin
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        intercept = 0.0
    return AttentionProfile(s_per_flop=slope, intercept_s=intercept)


def fit_attention_profile(
    samples: Sequence[AttentionSample], shape: AttentionShape, prior: AttentionProfile = PRIOR_PROFILE
) -> AttentionProfile:
    """Fit seconds = intercept + coefficient * FLOPs by least squares over measured batches.

    No usable sample (empty batch, negative or non-finite time): the prior. All samples of one size, or a
    non-positive fitted slope: the prior's slope with the intercept fitted. A negative intercept: refit
    through the origin. The engine decides which samples to pass (e.g. the most recent few hundred).
    """
    xs: list[float] = []
    ys: list[float] = []
    for sample in samples:
        flops = batch_attention_flops(sample.pairs, shape)
        if flops > 0 and math.isfinite(sample.seconds) and sample.seconds >= 0:
            xs.append(flops)
            ys.append(sample.seconds)
    return _fit_line(xs, ys, prior) if xs else prior


# ------------------------------------------------------------------------------------------ batching


@dataclass(frozen=True, slots=True)
class BatchingLimits:
    """Per-batch limits: predicted attention-layer time (the compute quota) and a token cap."""

    compute_quota_s: float = COMPUTE_QUOTA_S
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if not (math.isfinite(self.compute_quota_s) and self.compute_quota_s > 0):
            raise ConfigError(f"compute_quota_s={self.compute_quota_s}: must be > 0", param="compute_quota_s")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1",
                param="max_num_batched_tokens",
            )


@dataclass(frozen=True, slots=True)
class PrefillWork:
    """A waiting prefill: `cached_tokens` have KV (hits or earlier chunks), `remaining_tokens` to compute."""

    request_id: str
    cached_tokens: int
    remaining_tokens: int

    def __post_init__(self) -> None:
        if self.cached_tokens < 0 or self.remaining_tokens < 1:
            raise KvpathError(
                f"prefill {self.request_id}: cached_tokens={self.cached_tokens} must be >= 0 and "
                f"remaining_tokens={self.remaining_tokens} >= 1"
            )


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One request's share of a batch: compute `new_tokens` after `cached_tokens`; `is_last_chunk` when this
    finishes its prompt (the engine samples its first token)."""

    request_id: str
    cached_tokens: int
    new_tokens: int
    is_last_chunk: bool


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A batch, its predicted attention-layer seconds, and the waiting queue after it (a chunked request stays
    at the head with `cached_tokens` advanced)."""

    items: tuple[BatchItem, ...]
    predicted_attention_s: float
    queue: tuple[PrefillWork, ...]


def largest_fitting_chunk(
    work: PrefillWork,
    max_tokens: int,
    batch_flops: float,
    budget_s: float,
    profile: AttentionProfile,
    shape: AttentionShape,
) -> int:
    """Largest chunk in [0, max_tokens] of `work` whose addition keeps the batch within `budget_s` (binary
    search: predicted time grows with the chunk)."""
    lo, hi = 0, max_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if profile.predict_s(batch_flops + attention_flops(work.cached_tokens, mid, shape)) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_prefill_batch(
    queue: Sequence[PrefillWork],
    profile: AttentionProfile,
    shape: AttentionShape,
    limits: BatchingLimits = BatchingLimits(),
) -> BatchPlan:
    """FIFO packing under the compute quota and the token cap (brief 5.5).

    Whole requests join while the batch stays within both limits; the first that does not is chunk-prefilled
    with the largest chunk that fits (binary search) and the batch is closed. If not even one of its tokens
    fits an otherwise empty batch (a huge cached context, or a fixed cost above the quota), it gets exactly
    one token anyway: every batch makes progress, and one token overshoots the quota by the least possible.
    """
    items: list[BatchItem] = []
    flops = 0.0
    num_tokens = 0
    for index, work in enumerate(queue):
        room = min(work.remaining_tokens, limits.max_num_batched_tokens - num_tokens)
        whole_s = profile.predict_s(flops + attention_flops(work.cached_tokens, room, shape))
        if whole_s <= limits.compute_quota_s:
            chunk = room  # the whole request (or all the token cap leaves) fits the quota
        else:
            chunk = largest_fitting_chunk(work, room, flops, limits.compute_quota_s, profile, shape)
        if chunk == 0 and not items:
            chunk = 1
        if chunk == 0:
            break
        is_last = chunk == work.remaining_tokens
        items.append(BatchItem(work.request_id, work.cached_tokens, chunk, is_last))
        flops += attention_flops(work.cached_tokens, chunk, shape)
        num_tokens += chunk
        if not is_last:
            head = PrefillWork(work.request_id, work.cached_tokens + chunk, work.remaining_tokens - chunk)
            return BatchPlan(tuple(items), profile.predict_s(flops), (head, *queue[index + 1 :]))
    return BatchPlan(tuple(items), profile.predict_s(flops), tuple(queue[len(items) :]))

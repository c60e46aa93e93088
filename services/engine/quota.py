"""A prefill engine's compute quota (DualPath §5.5): plan each batch with the pure batching policy, learn the
attention-time profile from the batches it ran."""

from __future__ import annotations

from collections import deque
from typing import Any

from services.engine.batching import (
    PRIOR_PROFILE,
    AttentionProfile,
    AttentionSample,
    AttentionShape,
    BatchingLimits,
    PrefillWork,
    fit_attention_profile,
    plan_prefill_batch,
)
from services.engine.config import EngineConfig

MAX_SAMPLES = 256
REFIT_EVERY = 8


class QuotaPlanner:
    """Stateful wrapper: the profile is refit from the last MAX_SAMPLES batches every REFIT_EVERY batches.

    A sample's seconds are the measured forward time per layer, so the fitted "attention time" includes the
    rest of the layer (MLP, KV copies) as a fixed plus per-FLOP cost: what the quota should bound in practice.
    """

    def __init__(
        self, shape: AttentionShape, limits: BatchingLimits, prior: AttentionProfile = PRIOR_PROFILE
    ) -> None:
        self.shape = shape
        self.limits = limits
        self.profile = prior
        self._prior = prior
        self._samples: deque[AttentionSample] = deque(maxlen=MAX_SAMPLES)
        self._since_fit = 0
        self.last_predicted_s = 0.0

    def plan(self, work: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
        queue = [PrefillWork(rid, cached, remaining) for rid, cached, remaining in work]
        if not queue:
            return []
        plan = plan_prefill_batch(queue, self.profile, self.shape, self.limits)
        self.last_predicted_s = plan.predicted_attention_s
        return [(item.request_id, item.new_tokens) for item in plan.items]

    def observe(self, pairs: list[tuple[int, int]], seconds_per_layer: float) -> None:
        if not pairs or seconds_per_layer <= 0:
            return
        self._samples.append(AttentionSample(tuple(pairs), seconds_per_layer))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            self.profile = fit_attention_profile(list(self._samples), self.shape, self._prior)


def quota_planner(config: EngineConfig, runner: Any) -> QuotaPlanner | None:
    """The compute-quota batch planner of a prefill engine (None: a plain token budget)."""
    if config.role != "prefill" or config.compute_quota_s <= 0:
        return None
    arch = runner.arch
    head_dim = arch.qk_nope_head_dim + arch.qk_rope_head_dim if arch.attention == "mla" else arch.head_dim
    limits = BatchingLimits(
        compute_quota_s=config.compute_quota_s, max_num_batched_tokens=config.max_num_batched_tokens
    )
    return QuotaPlanner(AttentionShape(num_q_heads=arch.num_heads, head_dim=head_dim), limits)


class RateMeter:
    """Exponentially weighted work rate (units per busy second)."""

    __slots__ = ("_weight", "value")

    def __init__(self, weight: float = 0.2) -> None:
        self._weight = weight
        self.value = 0.0

    def add(self, units: float, seconds: float) -> None:
        if seconds <= 0 or units <= 0:
            return
        rate = units / seconds
        self.value = rate if self.value == 0 else (1 - self._weight) * self.value + self._weight * rate

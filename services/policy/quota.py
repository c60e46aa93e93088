"""A prefill engine's compute quota (DualPath §5.5): plan each batch with the pure batching policy, learn the
attention-time profile from the batches it ran; and the rate meter behind DualPath's beta.

No I/O and no clock: the engine passes the measured seconds in, the simulator its simulated ones."""

from __future__ import annotations

from collections import deque

from services.policy.batching import (
    PRIOR_PROFILE,
    AttentionProfile,
    AttentionSample,
    AttentionShape,
    BatchingLimits,
    PrefillWork,
    fit_attention_profile,
    plan_prefill_batch,
)

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


RATE_WEIGHT = 0.2  # weight of the newest sample


class RateMeter:
    """Exponentially weighted work rate (units per busy second): a PE's prefill rate, which its load report
    carries and the router turns into beta (the simulator keeps one per simulated PE)."""

    __slots__ = ("_weight", "value")

    def __init__(self, weight: float = RATE_WEIGHT) -> None:
        self._weight = weight
        self.value = 0.0

    def add(self, units: float, seconds: float) -> None:
        if seconds <= 0 or units <= 0:
            return
        rate = units / seconds
        self.value = rate if self.value == 0 else (1 - self._weight) * self.value + self._weight * rate


MIN_STEP_TOKENS = 64


def step_budget(
    compute_tokens_per_s: float, target_s: float, max_tokens: int, min_tokens: int = MIN_STEP_TOKENS
) -> int:
    """Prefill tokens per step so that a step takes about `target_s` at the measured compute rate, within
    [min_tokens, max_tokens] (`max_tokens` until a rate is measured, or with no target). Sarathi-Serve sizes
    its chunks from a time-between-tokens target the same way. Measured on steps of the budget it sets, the
    rate b / (c0 + c1 b) of a step with fixed cost c0 makes the budget settle where a step takes `target_s`
    (the map's slope there is c0 / target_s < 1)."""
    if target_s <= 0 or compute_tokens_per_s <= 0:
        return max_tokens
    return max(min(min_tokens, max_tokens), min(max_tokens, int(compute_tokens_per_s * target_s)))

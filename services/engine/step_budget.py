"""A step's prefill token budget from a time target (`--step-target-s`): on hardware where a step of the fixed
budget takes seconds (2,048 SmolLM2 tokens take 5-7 s on two CPU cores), every running decode stalls that long
and a warm turn that the shortest-first order would admit next waits for it. The engine sizes the budget
from the compute rate it measures (`services/policy/quota.step_budget`; the warm-up prefill gives the first
one), for the plain token budget and for a prefill engine's compute-quota planner alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from services.engine.config import EngineConfig
from services.policy.batching import AttentionShape, BatchingLimits
from services.policy.quota import QuotaPlanner, RateMeter, step_budget

if TYPE_CHECKING:
    from gpu.runner import ModelRunner


def adaptive_budget(
    config: EngineConfig, quota: QuotaPlanner | None, rate: RateMeter
) -> Callable[[], int] | None:
    """The scheduler's `step_budget`: None without a target (the fixed `max_num_batched_tokens`)."""
    if config.step_target_s <= 0:
        return None

    def budget() -> int:
        tokens = step_budget(rate.value, config.step_target_s, config.max_num_batched_tokens)
        if quota is not None and quota.limits.max_num_batched_tokens != tokens:
            quota.limits = replace(quota.limits, max_num_batched_tokens=tokens)
        return tokens

    return budget


def quota_planner(config: EngineConfig, runner: ModelRunner) -> QuotaPlanner | None:
    """The compute-quota batch planner of a prefill engine (None: a plain token budget)."""
    if config.role != "prefill" or config.compute_quota_s <= 0:
        return None
    spec = runner.spec
    limits = BatchingLimits(
        compute_quota_s=config.compute_quota_s, max_num_batched_tokens=config.max_num_batched_tokens
    )
    return QuotaPlanner(AttentionShape(num_q_heads=spec.num_heads, head_dim=spec.head_dim), limits)

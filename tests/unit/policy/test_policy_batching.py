"""PE batching under a compute quota (brief 5.5) and the attention-time profile fit."""

from __future__ import annotations

import pytest

from services.policy.batching import (
    PRIOR_PROFILE,
    AttentionProfile,
    AttentionSample,
    AttentionShape,
    BatchingLimits,
    BatchItem,
    PrefillWork,
    attention_flops,
    fit_attention_profile,
    plan_prefill_batch,
)
from shared.errors import ConfigError, KvpathError

UNIT = AttentionShape(num_q_heads=1, head_dim=1)  # 4 FLOPs per query-key pair
MS_PER_FLOP = AttentionProfile(s_per_flop=1e-3)  # 1 FLOP = 1 ms: a 1 s quota holds 1000 FLOPs = 250 pairs


def work(rid: str, cached: int, remaining: int) -> PrefillWork:
    return PrefillWork(rid, cached, remaining)


def test_attention_flops_follow_the_causal_formula() -> None:
    shape = AttentionShape(num_q_heads=8, head_dim=64)
    # 3 new queries after 5 cached keys attend to 6, 7 and 8 keys: 21 pairs
    assert attention_flops(5, 3, shape) == 4 * 8 * 64 * 21
    assert attention_flops(100, 0, shape) == 0


def test_fifo_packing_fills_the_quota_then_chunks_by_binary_search() -> None:
    queue = [work("a", 0, 10), work("b", 0, 10), work("c", 100, 5), work("d", 0, 1)]
    plan = plan_prefill_batch(queue, MS_PER_FLOP, UNIT, BatchingLimits(compute_quota_s=1.0))
    # a and b: 55 pairs = 220 FLOPs each (0.44 s). c whole: 100*5 + 15 = 515 pairs, too much; 0.56 s left =
    # 140 pairs: 1 token costs 101 pairs, 2 tokens 203. So c gets a 1-token chunk and the batch closes.
    assert plan.items == (
        BatchItem("a", 0, 10, True),
        BatchItem("b", 0, 10, True),
        BatchItem("c", 100, 1, False),
    )
    assert plan.predicted_attention_s == pytest.approx((220 + 220 + 404) * 1e-3)
    assert plan.queue == (work("c", 101, 4), work("d", 0, 1))


@pytest.mark.parametrize("cached", [0, 7, 300, 5000])
@pytest.mark.parametrize("quota_s", [0.05, 0.4, 2.0])
@pytest.mark.parametrize("intercept_s", [0.0, 0.01])
def test_chunk_is_the_largest_the_cost_model_allows(cached: int, quota_s: float, intercept_s: float) -> None:
    profile = AttentionProfile(s_per_flop=1e-6, intercept_s=intercept_s)
    first = work("first", 20, 30)
    queue = [first, work("big", cached, 5000)]
    plan = plan_prefill_batch(queue, profile, UNIT, BatchingLimits(compute_quota_s=quota_s))

    def fits(n_first: int, n_big: int) -> bool:
        flops = attention_flops(20, n_first, UNIT) + attention_flops(cached, n_big, UNIT)
        return profile.predict_s(flops) <= quota_s

    n_first = max((n for n in range(31) if fits(n, 0)), default=0) or 1  # at least one token of progress
    expected = [("first", n_first)]
    if n_first == 30:
        n_big = max(n for n in range(5001) if fits(30, n))
        if n_big:
            expected.append(("big", n_big))
    assert [(i.request_id, i.new_tokens) for i in plan.items] == expected


def test_a_chunk_that_fills_the_quota_exactly_is_taken() -> None:
    # 4 tokens after 60 cached: 4 * 60 + 10 = 250 pairs = 1000 FLOPs = exactly the 1 s quota; 5 would overflow
    plan = plan_prefill_batch([work("a", 60, 10)], MS_PER_FLOP, UNIT, BatchingLimits(compute_quota_s=1.0))
    assert [i.new_tokens for i in plan.items] == [4]
    assert plan.predicted_attention_s == 1.0


def test_token_cap_is_a_second_limit() -> None:
    queue = [work("a", 0, 10), work("b", 0, 10)]
    plan = plan_prefill_batch(
        queue, MS_PER_FLOP, UNIT, BatchingLimits(compute_quota_s=1e6, max_num_batched_tokens=15)
    )
    assert [(i.request_id, i.new_tokens, i.is_last_chunk) for i in plan.items] == [
        ("a", 10, True),
        ("b", 5, False),
    ]
    assert plan.queue == (work("b", 5, 5),)


def test_a_request_that_alone_exceeds_the_quota_still_progresses_one_token() -> None:
    huge = work("huge", 10**6, 50)  # one query over a million cached keys: 4e6 FLOPs, 4000 s > 0.3 s
    plan = plan_prefill_batch(
        [huge, work("next", 0, 1)], MS_PER_FLOP, UNIT, BatchingLimits(compute_quota_s=0.3)
    )
    assert plan.items == (BatchItem("huge", 10**6, 1, False),)
    assert plan.queue == (work("huge", 10**6 + 1, 49), work("next", 0, 1))


def test_an_oversized_request_behind_others_waits_for_the_next_batch() -> None:
    queue = [work("small", 0, 2), work("huge", 10**6, 50)]
    plan = plan_prefill_batch(queue, MS_PER_FLOP, UNIT, BatchingLimits(compute_quota_s=0.3))
    assert [i.request_id for i in plan.items] == ["small"]
    assert plan.queue == (work("huge", 10**6, 50),)


def test_fixed_cost_above_quota_gives_one_token_batches() -> None:
    profile = AttentionProfile(s_per_flop=1e-9, intercept_s=0.5)
    plan = plan_prefill_batch([work("a", 0, 8)], profile, UNIT, BatchingLimits(compute_quota_s=0.3))
    assert [i.new_tokens for i in plan.items] == [1]


def test_empty_queue_gives_an_empty_batch() -> None:
    plan = plan_prefill_batch([], MS_PER_FLOP, UNIT)
    assert (plan.items, plan.predicted_attention_s, plan.queue) == ((), 0.0, ())


def test_fit_recovers_known_coefficients() -> None:
    shape = AttentionShape(num_q_heads=4, head_dim=32)
    truth = AttentionProfile(s_per_flop=2.5e-10, intercept_s=0.004)
    batches = [((0, 64),), ((128, 32), (0, 16)), ((1024, 8),), ((4096, 128), (512, 512)), ((0, 2048),)]
    samples = [
        AttentionSample(b, truth.predict_s(sum(attention_flops(c, n, shape) for c, n in b))) for b in batches
    ]
    fitted = fit_attention_profile(samples, shape)
    assert fitted.s_per_flop == pytest.approx(truth.s_per_flop, rel=1e-9)
    assert fitted.intercept_s == pytest.approx(truth.intercept_s, rel=1e-6)


def test_fit_falls_back_sanely() -> None:
    shape = UNIT
    assert fit_attention_profile([], shape) == PRIOR_PROFILE
    assert fit_attention_profile(
        [AttentionSample((), 1.0), AttentionSample(((0, 4),), float("nan"))], shape
    ) == (PRIOR_PROFILE)
    # one batch size: keep the prior's slope, fit the fixed cost
    prior = AttentionProfile(s_per_flop=1e-3)
    one_size = [AttentionSample(((0, 4),), 0.1), AttentionSample(((0, 4),), 0.12)]  # 40 FLOPs -> 0.04 s
    fitted = fit_attention_profile(one_size, shape, prior)
    assert fitted.s_per_flop == 1e-3
    assert fitted.intercept_s == pytest.approx(0.07)
    # a line whose intercept would be negative is refitted through the origin
    through_origin = [AttentionSample(((0, 4),), 0.0), AttentionSample(((0, 9),), 0.5)]  # 40 and 180 FLOPs
    fitted = fit_attention_profile(through_origin, shape, prior)
    assert fitted.intercept_s == 0.0
    assert fitted.s_per_flop == pytest.approx(0.5 * 180 / (40**2 + 180**2))


def test_limits_and_work_are_validated() -> None:
    with pytest.raises(ConfigError, match="compute_quota_s"):
        BatchingLimits(compute_quota_s=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        BatchingLimits(max_num_batched_tokens=0)
    with pytest.raises(KvpathError, match="remaining_tokens=0"):
        PrefillWork("r", 0, 0)

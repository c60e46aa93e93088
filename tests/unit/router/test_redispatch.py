"""When a lost attempt is sent again (pure): the limit, the deadline, tokens left to migrate; a migrated
request's plan; the router's limits validated."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from services.router.config import RouterConfig
from services.router.redispatch import Redispatch, resumed_plan
from shared.errors import ConfigError
from shared.protocol import KvPlan, RequestPlan, SamplingParams
from shared.protocol.movequery import ChunkName


def _again(limit: int) -> Redispatch:
    plan = RequestPlan(
        request_id="r", router_id="x", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=8),
        deadline_unix_s=2e9,
    )  # fmt: skip
    return Redispatch.of(plan, {}, limit)


def test_a_lost_attempt_is_sent_again_within_its_limit_and_deadline() -> None:
    later = time.monotonic() + 60
    assert not _again(0).may(later)  # max_redispatches 0: never
    again = _again(2)
    assert again.may(later)
    assert not again.may(time.monotonic() - 1)  # past its deadline
    again.count = 2
    assert not again.may(later)  # its two attempts are spent


def test_after_tokens_it_migrates_while_tokens_are_left_and_no_chunk_is_pinned() -> None:
    later = time.monotonic() + 60
    again = _again(2)
    assert again.record([7, 8]) == 2 and again.output == [7, 8]
    assert again.may(later)
    again.record([9] * 6)
    assert not again.may(later)  # all 8 of max_tokens went out: nothing to resume
    pinned = _again(2)
    pinned.plan.pin = ChunkName(name="doc", tenant="")
    assert pinned.may(later)  # before its first token a pinning request is sent again
    pinned.record([7])
    assert not pinned.may(later)  # its prompt is the chunk: it does not grow by the output


def test_a_migrated_plan_prompts_with_the_output_and_generates_what_is_left() -> None:
    plan = _again(2).plan
    plan.sampling = replace(plan.sampling, min_tokens=3, seed=5)
    kv = KvPlan(block_hashes=[11, 12], num_hit_blocks=1)
    resumed = resumed_plan(plan, [7, 8], kv)
    assert resumed.prompt_token_ids == [1, 2, 7, 8] and resumed.num_resumed_tokens == 2
    assert (resumed.sampling.max_tokens, resumed.sampling.min_tokens, resumed.sampling.seed) == (6, 1, 5)
    assert resumed.kv is kv and resumed.request_id == plan.request_id
    assert plan.prompt_token_ids == [1, 2] and plan.sampling.max_tokens == 8  # the original untouched
    assert resumed_plan(plan, [7, 8, 9, 10], kv).sampling.min_tokens == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_redispatches", -1), ("request_read_timeout_s", 0.0), ("stream_write_timeout_s", 0.0)],
)
def test_the_routers_client_and_retry_limits_are_checked(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{field: value}).validate()

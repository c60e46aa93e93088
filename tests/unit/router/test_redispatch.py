"""When a lost attempt is sent again (pure): the limit, the deadline, and migration only where the engines
resume; the router's limits validated."""

from __future__ import annotations

import time

import pytest

from services.router.config import RouterConfig
from services.router.redispatch import Redispatch
from shared.errors import ConfigError
from shared.protocol import RequestPlan, SamplingParams


def _again(limit: int) -> Redispatch:
    plan = RequestPlan(
        request_id="r", router_id="x", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=8),
        deadline_unix_s=2e9,
    )  # fmt: skip
    return Redispatch.of(plan, {}, limit)


def test_a_lost_attempt_is_sent_again_within_its_limit_and_deadline() -> None:
    later = time.monotonic() + 60
    assert not _again(0).may(later, resumes=True)  # max_redispatches 0: never
    again = _again(2)
    assert again.may(later, resumes=False)  # no token out: any dispatch may send it again
    assert not again.may(time.monotonic() - 1, resumes=True)  # past its deadline
    again.count = 2
    assert not again.may(later, resumes=True)  # its two attempts are spent


def test_after_a_token_only_engines_that_resume_take_it_with_its_tokens() -> None:
    later = time.monotonic() + 60
    again = _again(2)
    assert again.record([7, 8]) == 2 and again.output == [7, 8]
    assert not again.may(later, resumes=False)  # a hand-off cannot carry the tokens: the stream ends
    assert again.may(later, resumes=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_redispatches", -1), ("request_read_timeout_s", 0.0), ("stream_write_timeout_s", 0.0)],
)
def test_the_routers_client_and_retry_limits_are_checked(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{field: value}).validate()

"""The error a request gets when no engine took it (`services/router/dispatch.undispatched`)."""

from __future__ import annotations

import time

from services.router.dispatch import TIMER_SLACK_S, undispatched
from shared.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    NoEngineAvailableError,
    OverloadedError,
    ServiceUnavailableError,
)


def test_a_lost_ack_at_the_deadline_is_a_504_even_when_the_timer_fired_early() -> None:
    lost = DeadlineExceededError("no reply on kvpath.task.engine-0 within 1.0s")
    # the ack wait was cut to the deadline and its timer fired a little early (uvloop's millisecond clock)
    error = undispatched(lost, time.monotonic() + TIMER_SLACK_S / 2, "engine")
    assert isinstance(error, DeadlineExceededError) and error.http_status == 504
    assert "deadline passed" in error.message


def test_a_lost_ack_with_time_left_is_a_503_naming_it() -> None:
    lost = DeadlineExceededError("no reply on kvpath.task.engine-0 within 5.0s")
    error = undispatched(lost, time.monotonic() + 10.0, "session engine")
    assert isinstance(error, NoEngineAvailableError) and error.http_status == 503
    assert error.message == f"no session engine is available (last error: {lost.message})"


def test_an_overload_stays_a_429_and_no_refusal_is_a_503() -> None:
    busy = OverloadedError("queue full")
    assert undispatched(busy, time.monotonic() - 1.0, "engine") is busy
    nobody = undispatched(None, time.monotonic() - 1.0, "prefill/decode engine")
    assert isinstance(nobody, NoEngineAvailableError)
    assert nobody.message == "no prefill/decode engine is available"
    gone = undispatched(ServiceUnavailableError("no service answers"), time.monotonic() - 1.0, "engine")
    assert isinstance(gone, NoEngineAvailableError)


def test_a_prompt_no_tried_engines_cache_holds_stays_a_400() -> None:
    too_long = ContextLengthExceededError("prompt of 9000 tokens does not fit this engine's KV cache")
    assert undispatched(too_long, time.monotonic() + 10.0, "engine") is too_long
    assert too_long.http_status == 400

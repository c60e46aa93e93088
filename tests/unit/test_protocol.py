"""Message schemas: round trips, and every malformed input rejected with the offending field named."""

from __future__ import annotations

import pytest

from shared.errors import ProtocolError
from shared.protocol import (
    Abort,
    GenerateTask,
    SamplingParams,
    Subjects,
    TokenBatch,
    TokenDelta,
    decode,
    encode,
)


def test_round_trip_nested() -> None:
    batch = TokenBatch(
        engine_id="e1",
        step=7,
        deltas=[
            TokenDelta(request_id="r1", seq=0, token_ids=[1, 2, 3], prompt_tokens=9, cached_tokens=0),
            TokenDelta(request_id="r2", seq=4, token_ids=[], finish_reason="length"),
        ],
    )
    assert decode(encode(batch), TokenBatch) == batch


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"kind": "abort", "v": 1, "request_id": "r"}', "unexpected message kind"),
        (
            b'{"kind": "token_batch", "v": 99, "engine_id": "e", "step": 1, "deltas": []}',
            "unsupported version",
        ),
        (b'{"kind": "token_batch", "v": 1, "engine_id": "e", "deltas": []}', "missing field 'step'"),
        (
            b'{"kind": "token_batch", "v": 1, "engine_id": "e", "step": true, "deltas": []}',
            "step: expected an integer",
        ),
        (
            b'{"kind": "token_batch", "v": 1, "engine_id": "e", "step": 1, "deltas": [{"request_id": "r", '
            b'"seq": 0, "token_ids": [1, "x"]}]}',
            "deltas[0].token_ids",
        ),
    ],
)
def test_malformed_rejected(payload: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(payload, TokenBatch)
    assert fragment in err.value.message


def test_defaults_fill_missing_optional_fields() -> None:
    task = decode(
        b'{"kind": "generate_task", "v": 1, "request_id": "r", "router_id": "x", '
        b'"prompt_token_ids": [5], "sampling": {"max_tokens": 3}, "deadline_unix_s": 1}',
        GenerateTask,
    )
    assert task.sampling == SamplingParams(max_tokens=3)
    assert task.deadline_unix_s == 1.0 and task.session_id == ""


def test_accepts_any_of_several_kinds() -> None:
    msg = decode(encode(Abort(request_id="r")), (TokenBatch, Abort))
    assert isinstance(msg, Abort)


def test_subjects_reject_wildcards() -> None:
    subjects = Subjects("ns1")
    assert subjects.task("engine-0") == "kvpath.ns1.task.engine-0"
    for bad in ("a.b", "a*", ">", "a b"):
        with pytest.raises(ValueError):
            subjects.task(bad)

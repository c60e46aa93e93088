"""Message schemas: round trips, and every malformed input rejected with the offending field named."""

from __future__ import annotations

import pytest

from shared.errors import ProtocolError
from shared.protocol import (
    Abort,
    GenerateTask,
    KvPlan,
    RequestPlan,
    SamplingParams,
    Subjects,
    TokenBatch,
    TokenDelta,
    decode,
    encode,
)
from shared.protocol.tasks import BufferRef, DecodeTask, PrefillDone, PrefillTask, Task


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
        b'{"kind": "generate_task", "v": 2, "plan": {"request_id": "r", "router_id": "x", '
        b'"prompt_token_ids": [5], "sampling": {"max_tokens": 3}, "deadline_unix_s": 1}}',
        GenerateTask,
    )
    plan = task.plan
    assert plan.sampling == SamplingParams(max_tokens=3)
    assert plan.deadline_unix_s == 1.0 and plan.session_id == "" and plan.kv == KvPlan()
    assert task.request_id == "r" and task.timings == {}


def test_a_task_of_the_old_layout_is_refused_by_version() -> None:
    old = b'{"kind": "generate_task", "v": 1, "request_id": "r", "router_id": "x", "prompt_token_ids": [5]}'
    with pytest.raises(ProtocolError, match="unsupported version 1"):
        decode(old, GenerateTask)


def test_every_task_kind_shares_the_plan_and_round_trips() -> None:
    plan = RequestPlan(
        request_id="r",
        router_id="x",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4, seed=7),
        deadline_unix_s=5.0,
        kv=KvPlan(block_hashes=[2**64 - 1], num_hit_blocks=0, read_side="de"),
    )
    buffer = BufferRef(engine_id="d", endpoint={"a": 1}, region="de_buffer", offset=0, slot=1, num_blocks=1)
    tasks = [
        GenerateTask(plan=plan),
        DecodeTask(plan=plan, pe_id="p"),
        PrefillTask(plan=plan, de_buffer=buffer, is_layerwise=False, timings={"schedule_s": 0.5}),
    ]
    for task in tasks:
        back = decode(encode(task), Task)  # any kind, validated against the base
        assert back == task and type(back) is type(task)
        assert back.plan is not plan and back.plan == plan
    with pytest.raises(ProtocolError, match="expected generate_task"):
        decode(encode(tasks[1]), GenerateTask)  # a colocated engine refuses a decode task
    done = decode(encode(PrefillDone(first_token=9, num_loaded_blocks=2)), PrefillDone)
    assert (done.first_token, done.finish_reason, done.error) == (9, "", "")


def test_accepts_any_of_several_kinds() -> None:
    msg = decode(encode(Abort(request_id="r")), (TokenBatch, Abort))
    assert isinstance(msg, Abort)


def test_subjects_reject_wildcards() -> None:
    subjects = Subjects("ns1")
    assert subjects.task("engine-0") == "kvpath.ns1.task.engine-0"
    for bad in ("a.b", "a*", ">", "a b"):
        with pytest.raises(ValueError):
            subjects.task(bad)

"""Message schemas: round trips, and every malformed input rejected with the offending field named."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from shared.errors import ProtocolError
from shared.protocol import (
    Abort,
    GenerateTask,
    KvPlan,
    LoadReport,
    RequestPlan,
    RouteCapability,
    SamplingParams,
    Subjects,
    TokenBatch,
    TokenDelta,
    decode,
    encode,
)
from shared.protocol.kv import BlockRemoved, BlockStored
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
        (  # a list of ints holds ints only: not a bool, not a float that happens to be whole
            b'{"kind": "token_batch", "v": 1, "engine_id": "e", "step": 1, "deltas": [{"request_id": "r", '
            b'"seq": 0, "token_ids": [1, true]}]}',
            "deltas[0].token_ids: expected a list of int",
        ),
        (
            b'{"kind": "token_batch", "v": 1, "engine_id": "e", "step": 1, "deltas": [{"request_id": "r", '
            b'"seq": 0, "token_ids": [1, 2.0]}]}',
            "deltas[0].token_ids: expected a list of int",
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
    resumed = dataclasses.replace(plan, num_resumed_tokens=1)  # migrated: every task kind carries it
    for task in tasks:
        assert decode(encode(dataclasses.replace(task, plan=resumed)), Task).plan.num_resumed_tokens == 1
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


def _task(**overrides: object) -> dict:
    """A valid generate task as plain JSON, with fields of its plan / sampling / KV plan replaced."""
    plan = RequestPlan(
        request_id="r1",
        router_id="router-0",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4),
        deadline_unix_s=2e9,
        kv=KvPlan(block_hashes=[5, 6], num_hit_blocks=1),
    ).to_dict()
    for path, value in overrides.items():
        target = plan
        *parents, name = path.split("__")
        for parent in parents:
            target = target[parent]
        target[name] = value
    return GenerateTask(plan=decode(orjson.dumps(plan), RequestPlan)).to_dict() | {"plan": plan}


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"sampling__temperature": -5}, "sampling.temperature: expected a number in [0.0, 2.0], got -5.0"),
        ({"sampling__top_p": 1.5}, "top_p: expected a number in [0.0, 1.0]"),
        ({"sampling__max_tokens": -1}, "max_tokens: expected a number >= 1"),
        (
            {"sampling__logit_bias_values": [1.0, 101.0], "sampling__logit_bias_ids": [1, 2]},
            "logit_bias_values",
        ),
        ({"sampling__logit_bias_ids": [1]}, "logit_bias_ids and logit_bias_values differ"),
        ({"sampling__repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"router_id": "a.b.>"}, "router id 'a.b.>' cannot be a subject token"),
        ({"request_id": ""}, "request_id must have 1 to"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids: expected a number >= 0"),
        ({"deadline_unix_s": -1}, "deadline_unix_s"),
        ({"kv__num_hit_blocks": 3}, "num_hit_blocks 3 > 2 block hashes"),
        ({"kv__block_hashes": [-3]}, "block_hashes: expected a number in [0, 18446744073709551615], got -3"),
        ({"kv__read_side": "xx"}, "read_side 'xx'"),
        ({"num_resumed_tokens": 4}, "num_resumed_tokens must leave at least one token of the original"),
        ({"num_resumed_tokens": -1}, "num_resumed_tokens: expected a number >= 0"),
        ({"num_resumed_tokens": 1, "sampling__n": 2}, "a migrated request samples one choice"),
    ],
)
def test_out_of_range_tasks_are_rejected_on_receipt(overrides: dict, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(orjson.dumps(_task(**overrides)), GenerateTask)
    assert fragment in err.value.message


def test_in_range_edges_are_accepted() -> None:
    """OpenAI's edges: top_p 0 (greedy), temperature 0 and 2, penalties at +-2."""
    edges = {"sampling__top_p": 0, "sampling__temperature": 2, "sampling__presence_penalty": -2}
    task = decode(orjson.dumps(_task(**edges)), GenerateTask)
    assert task.plan.sampling.top_p == 0.0 and task.plan.sampling.temperature == 2.0


@pytest.mark.parametrize(
    ("event", "fragment"),
    [
        (BlockStored(source="s", epoch=1, seq=1, location="bogus:x", block_hashes=[1]), "location 'bogus:x'"),
        (BlockStored(source="s", epoch=1, seq=1, location="hbm:a.b", block_hashes=[1]), "location 'hbm:a.b'"),
        (
            BlockStored(source="s", epoch=1, seq=1, location="store", block_hashes=[1, 2], parent_hashes=[0]),
            "1 parent",
        ),
        (BlockStored(source="s", epoch=1, seq=1, location="store", block_hashes=[-1]), "block_hashes"),
        (BlockRemoved(source="s", epoch=1, seq=1, location="cxl:", block_hashes=[1]), "location 'cxl:'"),
    ],
)
def test_forged_kv_events_are_rejected(event: BlockStored | BlockRemoved, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(encode(event), (BlockStored, BlockRemoved))
    assert fragment in err.value.message
    good = BlockStored(
        source="s", epoch=1, seq=1, location="hbm:engine-1", block_hashes=[1, 2], parent_hashes=[0, 1]
    )
    assert decode(encode(good), BlockStored) == good


def _report(**fields: object) -> LoadReport:
    return LoadReport(service_id="e0", role="colocated", node=0, seq=1, sent_at=0.0, **fields)  # type: ignore[arg-type]


ROUTE = RouteCapability(
    num_layers=4,
    rows_per_token=8,
    query_bytes_per_row=128,
    partial_bytes_per_row=136,
    kv_bytes_per_token_layer=512,
)


@pytest.mark.parametrize(
    ("report", "fragment"),
    [
        (_report(waiting_kv_tokens=-1), "waiting_kv_tokens"),
        (_report(route=dataclasses.replace(ROUTE, num_layers=0)), "num_layers"),
        (_report(route=dataclasses.replace(ROUTE, holder_queue_s=-0.5)), "holder_queue_s"),
        (_report(kv_release_s=[0.1, 0.2], kv_release_tokens=[64]), "differ in length"),
        (_report(kv_release_s=[0.2, 0.1], kv_release_tokens=[64, 64]), "ascending"),
        (_report(kv_release_s=[-0.1], kv_release_tokens=[64]), "kv_release_s"),
        (_report(kv_release_s=[0.1], kv_release_tokens=[-64]), "kv_release_tokens"),
        (_report(kv_release_s=[float("nan")], kv_release_tokens=[64]), "kv_release_s"),
        (_report(kv_release_s=[0.1] * 65, kv_release_tokens=[1] * 65), "more than 64"),
        (_report(decode_step_s=-0.01), "decode_step_s"),
        (_report(decode_step_s=float("nan")), "decode_step_s"),
        (_report(prefill_order="sjf"), "prefill_order"),
        (_report(prefill_left_tokens=[5, 3], num_prefills=2), "ascending"),
        (_report(prefill_left_tokens=[3, 5], num_prefills=1), "prefill_left_tokens"),  # more than it has
        (_report(prefill_left_tokens=[1] * 65, num_prefills=65), "prefill_left_tokens"),
        (_report(prefill_left_tokens=[-3], num_prefills=1), "prefill_left_tokens"),
        (_report(num_prefills=-1), "num_prefills"),
    ],
)
def test_load_reports_typed_fields_are_checked_on_receipt(report: LoadReport, fragment: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(encode(report), LoadReport)
    assert fragment in err.value.message
    good = _report(
        waiting_kv_tokens=3000,
        route=ROUTE,
        kv_release_s=[0.05, 0.05, 1.5],
        kv_release_tokens=[64, 0, 1024],
        decode_step_s=0.02,
        prefill_order="short-first",
        prefill_left_tokens=[132, 3100],
        num_prefills=3,  # a third, longer one unlisted
    )
    assert decode(encode(good), LoadReport) == good

"""Trace readers: round trips, format detection, and malformed lines reported with file:line and field."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from loadgen.formats import detect_format, kvpath, load_trace
from loadgen.trace import BlockTrace, MessagesTrace, Round, TraceFormatError, Trajectory, TrajectoryTrace


def write(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else orjson.dumps(x).decode()) + "\n" for x in lines))
    return path


def test_kvpath_round_trip(tmp_path: Path) -> None:
    trace = TrajectoryTrace(
        [
            Trajectory("a", 5, [Round(10, 2, 0.5, 77), Round(0, 1)], arrival_s=1.5),
            Trajectory("b", 6, [Round(3, 4, append_ids=(1, 2, 3))]),
        ],
        header={"kvpath_trace": 1, "profile": "x"},
    )
    assert kvpath.dump(tmp_path / "t.jsonl", trace) == 2
    back = load_trace(tmp_path / "t.jsonl")
    assert isinstance(back, TrajectoryTrace)
    assert back.trajectories == trace.trajectories and back.header["profile"] == "x"


def test_detect_format(tmp_path: Path) -> None:
    assert (
        detect_format(write(tmp_path / "a", {"agent": "a", "rounds": [{"append": 1, "gen": 1}]})) == "kvpath"
    )
    assert (
        detect_format(
            write(tmp_path / "b", {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]})
        )
        == "mooncake"
    )
    assert detect_format(write(tmp_path / "c", {"session": "s", "messages": []})) == "messages"
    with pytest.raises(TraceFormatError, match=r"c2:1: cannot tell the format"):
        detect_format(write(tmp_path / "c2", {"what": 1}))
    with pytest.raises(TraceFormatError, match="trace is empty"):
        detect_format(write(tmp_path / "e", ""))
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_mooncake_reads_seconds_and_sorts(tmp_path: Path) -> None:
    path = write(
        tmp_path / "m.jsonl",
        {"timestamp": 3000, "input_length": 513, "output_length": 2, "hash_ids": [0, 9]},
        "",
        {"timestamp": 1000, "input_length": 512, "output_length": 1, "hash_ids": [0]},
    )
    trace = load_trace(path)
    assert isinstance(trace, BlockTrace)
    assert [r.arrival_s for r in trace.requests] == [1.0, 3.0]
    assert trace.requests[1].hash_ids == (0, 9)


def test_messages_group_calls_by_session(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    path = write(
        tmp_path / "m.jsonl",
        {"session": "s1", "messages": msgs, "output_tokens": 3},
        {"session_id": "s2", "messages": msgs, "arrival_s": 2.0},
        {
            "session": "s1",
            "messages": [*msgs, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}],
            "tool_s": 0.25,
        },
    )
    trace = load_trace(path)
    assert isinstance(trace, MessagesTrace)
    assert [s.session_id for s in trace.sessions] == ["s1", "s2"]
    assert [c.output_tokens for c in trace.sessions[0].calls] == [3, None]
    assert trace.sessions[0].calls[1].tool_latency_s == 0.25 and trace.sessions[1].calls[0].arrival_s == 2.0


GOOD_ROUND = {"append": 5, "gen": 2}


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (["{not json"], r"t\.jsonl:1: not valid JSON"),
        ([[1, 2]], r"t\.jsonl:1: each line must be a JSON object, got list"),
        (
            [{"agent": "a", "rounds": [GOOD_ROUND]}, {"rounds": [GOOD_ROUND]}],
            r"t\.jsonl:2: missing field 'agent'",
        ),
        ([{"agent": "a", "rounds": []}], r":1: field 'rounds' must not be empty"),
        ([{"agent": "a", "rounds": [{"append": 5}]}], r":1: round 0: missing field 'gen'"),
        (
            [{"agent": "a", "rounds": [GOOD_ROUND, {"append": "5", "gen": 1}]}],
            r":1: round 1: field 'append' must be an integer, got '5'",
        ),
        ([{"agent": "a", "rounds": [{"append": 0, "gen": 1}]}], r"round 0: the first round must append"),
        ([{"agent": "a", "rounds": [{"append": 3, "gen": 0}]}], r"round 0: field 'gen' must be >= 1, got 0"),
        ([{"agent": "a", "rounds": [{"append": 3, "gen": 1, "tool_s": -1}]}], r"field 'tool_s' must be >= 0"),
        (
            [{"agent": "a", "rounds": [{"append": [1, -2], "gen": 1}]}],
            r"field 'append'\[1\] must be an integer",
        ),
        (
            [{"agent": "a", "rounds": [GOOD_ROUND]}, {"agent": "a", "rounds": [GOOD_ROUND]}],
            r":2: agent 'a' already defined on line 1",
        ),
        (
            [{"agent": "a", "rounds": [GOOD_ROUND]}, {"kvpath_trace": 1}],
            r":2: the 'kvpath_trace' header must be",
        ),
        ([{"kvpath_trace": 9}], r":1: unsupported kvpath_trace version 9"),
    ],
)
def test_malformed_kvpath_lines(tmp_path: Path, lines: list[object], pattern: str) -> None:
    path = write(tmp_path / "t.jsonl", *lines)
    with pytest.raises(TraceFormatError, match=pattern) as info:
        load_trace(path, "kvpath")
    assert info.value.code == "invalid_trace"


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        ({"input_length": 5, "output_length": 1, "hash_ids": [1]}, r":2: missing field 'timestamp'"),
        (
            {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]},
            r":2: input_length 1025 needs 3 hash_ids of 512 tokens, got 2",
        ),
        (
            {"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": [1]},
            r"field 'input_length' must be an integer",
        ),
        (
            {"timestamp": 0, "input_length": 9, "output_length": 0, "hash_ids": [1]},
            r"'output_length' must be >= 1",
        ),
        (
            {"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": "1"},
            r"'hash_ids' must be a list",
        ),
        (
            {"timestamp": True, "input_length": 9, "output_length": 1, "hash_ids": [1]},
            r"'timestamp' must be a number",
        ),
    ],
)
def test_malformed_mooncake_lines(tmp_path: Path, line: dict[str, object], pattern: str) -> None:
    good = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
    with pytest.raises(TraceFormatError, match=pattern):
        load_trace(write(tmp_path / "m.jsonl", good, line), "mooncake")


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, r":1: missing field 'session_id'"),
        ({"session": "s", "messages": []}, r"field 'messages' must not be empty"),
        (
            {"session": "s", "messages": [{"role": "robot", "content": "x"}]},
            r"messages\[0\]: role must be one of",
        ),
        (
            {"session": "s", "messages": [{"role": "user", "content": 3}]},
            r"content must be a string or a list",
        ),
        (
            {"session": "s", "messages": [{"role": "user", "content": "x"}], "output_tokens": 0},
            r">= 1, got 0",
        ),
    ],
)
def test_malformed_messages_lines(tmp_path: Path, line: dict[str, object], pattern: str) -> None:
    with pytest.raises(TraceFormatError, match=pattern):
        load_trace(write(tmp_path / "s.jsonl", line), "messages")


def test_unknown_format_name(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="unknown trace format 'csv'"):
        load_trace(write(tmp_path / "x", {"a": 1}), "csv")

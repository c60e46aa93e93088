"""Replay against a real HTTP server (the OpenAI-compatible stub): exact lengths, sessions, hit rates, errors,
strict servers, history modes, chat, online arrivals, steady-state stop, concurrency limit, Ctrl-C."""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadgen.config import ReplayConfig
from loadgen.formats import load_trace
from loadgen.result import SCHEMA, load_result
from loadgen.runner import run_replay
from tests.integration.loadgen.loadgen_openai_stub import StubServer

MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")
MOONCAKE = (
    MOONCAKE if MOONCAKE.exists() else Path(__file__).parents[4] / "shared/traces/mooncake_conversation.jsonl"
)


def write_trace(path: Path, agents: int, rounds: list[tuple[int, int]], tool_s: float = 0.0) -> Path:
    lines = []
    for a in range(agents):
        rs = [{"append": ap, "gen": g, **({"tool_s": tool_s} if tool_s else {})} for ap, g in rounds]
        lines.append(orjson.dumps({"agent": f"a{a}", "seed": 100 + a, "rounds": rs}).decode())
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
async def stub() -> AsyncIterator[StubServer]:
    server = StubServer()
    await server.start()
    yield server
    await server.stop()


async def replay(url: str, trace: Path, tmp_path: Path, **options: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "url": url,
        "trace": str(trace),
        "out": str(tmp_path / "result.json"),
        "progress": "off",
        "vocab_size": 256,
        "content_salt": 7,
        **options,
    }
    config = ReplayConfig(**fields)
    config.validate()
    return await run_replay(config, load_trace(config.trace, config.format))


def by_session(items: list[Any], key: Callable[[Any], str]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return out


async def test_offline_exact_lengths_sessions_and_hits(stub: StubServer, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", agents=3, rounds=[(40, 5), (20, 6), (33, 1), (10, 4)])
    result = await replay(stub.url, trace, tmp_path)
    s = result["summary"]
    assert s["requests"]["completed"] == 12 and s["requests"]["failed"] == 0
    assert s["requests"]["length_mismatches"] == 0 and result["meta"]["stop_reason"] == "completed"
    assert result["meta"]["model"] == "stub-model"
    for body in stub.bodies:
        assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    sessions = by_session(list(zip(stub.session_ids, stub.bodies, strict=True)), lambda x: x[0])
    assert len(sessions) == 3 and all(len(calls) == 4 for calls in sessions.values())
    for calls in sessions.values():
        prompts = [body["prompt"] for _, body in calls]
        assert [len(p) for p in prompts] == [40, 40 + 5 + 20, 65 + 6 + 33, 104 + 1 + 10]
        for before, after in itertools.pairwise(prompts):
            assert after[: len(before)] == before  # each turn extends the last prompt
        assert all(0 <= t < 256 for p in prompts for t in p)
    records = by_session(result["requests"], lambda r: r["session_id"])
    for recs in records.values():
        recs.sort(key=lambda r: r["turn"])
        for prev, rec in itertools.pairwise(recs):
            assert rec["ideal_cached_tokens"] == prev["prompt_tokens"]
            assert rec["cached_tokens"] == prev["prompt_tokens"] // 16 * 16  # the stub's 16-token blocks
            assert rec["t_start_s"] >= prev["t_end_s"]  # closed loop
        assert all(r["output_tokens"] == r["max_tokens"] and r["ttft_s"] > 0 for r in recs)
        assert all(r["ttst_s"] is not None for r in recs if r["max_tokens"] >= 2)
    assert s["hit_rate"]["per_turn"][0]["hit_rate"] == 0.0 and s["hit_rate"]["from_turn_2"] > 0.5
    assert s["jct"]["all_agents_s"] >= max(r["e2e_s"] for r in result["requests"])
    assert load_result(tmp_path / "result.json")["schema"] == SCHEMA


async def test_strict_server_needs_exact_lengths_off(tmp_path: Path) -> None:
    server = StubServer(strict=True)
    await server.start()
    try:
        trace = write_trace(tmp_path / "t.jsonl", agents=2, rounds=[(30, 8), (10, 8)])
        refused = await replay(server.url, trace, tmp_path)
        assert refused["summary"]["requests"]["failed"] == 2  # one per session: it ends after a failure
        assert refused["summary"]["requests"]["errors"] == {"unknown_field": 2}
        assert all(r["status"] == 400 for r in refused["requests"])
        plain = await replay(server.url, trace, tmp_path, exact_lengths=False, temperature=-1.0)
    finally:
        await server.stop()
    assert plain["summary"]["requests"]["completed"] == 4
    assert "temperature" not in server.bodies[-1] and "ignore_eos" not in server.bodies[-1]
    # without ignore_eos the stub stops early, and the replay reports it
    assert plain["summary"]["requests"]["length_mismatches"] == 4


async def test_server_errors_are_recorded_and_sessions_continue(tmp_path: Path) -> None:
    def fail(body: dict[str, Any], headers: Any) -> tuple[int, str] | None:
        return (
            (503, "overloaded")
            if headers["X-Session-Id"].endswith("a1") and len(body["prompt"]) > 30
            else None
        )

    server = StubServer(fail=fail)
    await server.start()
    try:
        trace = write_trace(tmp_path / "t.jsonl", agents=2, rounds=[(30, 2), (10, 2), (10, 2)])
        result = await replay(server.url, trace, tmp_path, on_error="continue")
    finally:
        await server.stop()
    failed = [r for r in result["requests"] if r["error"] is not None]
    assert len(failed) == 2 and {r["turn"] for r in failed} == {1, 2}
    assert all(r["status"] == 503 and r["error_code"] == "injected" for r in failed)
    assert result["summary"]["requests"]["completed"] == 4
    assert result["summary"]["slo"]["per_request_attainment"] <= 4 / 6


async def test_history_output_appends_the_returned_token_ids(stub: StubServer, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", agents=1, rounds=[(40, 8), (20, 8), (5, 3)])
    result = await replay(stub.url, trace, tmp_path, history="output")
    assert all(b["return_token_ids"] is True for b in stub.bodies)
    prompts = [b["prompt"] for b in stub.bodies]
    assert prompts[1][40:48] == [(40 * 31 + i * 7) % 256 for i in range(8)]  # the stub's output tokens
    recs = sorted(result["requests"], key=lambda r: r["turn"])
    assert recs[1]["ideal_cached_tokens"] == 48 and recs[1]["cached_tokens"] == 48
    assert recs[2]["ideal_cached_tokens"] == 76 and recs[2]["cached_tokens"] == 64
    assert result["meta"]["history_fallbacks"] == 0


async def test_chat_endpoint_replays_a_messages_trace(stub: StubServer, tmp_path: Path) -> None:
    calls = [
        {"session": "s1", "messages": [{"role": "user", "content": "hello there"}], "output_tokens": 4},
        {
            "session": "s1",
            "messages": [
                {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "abcdefgh"},
                {"role": "user", "content": "and now?"},
            ],
        },
    ]
    trace = tmp_path / "m.jsonl"
    trace.write_text("\n".join(orjson.dumps(c).decode() for c in calls))
    result = await replay(stub.url, trace, tmp_path, endpoint="chat", default_output_tokens=6)
    assert [b["messages"] for b in stub.bodies] == [c["messages"] for c in calls]
    assert [b["max_tokens"] for b in stub.bodies] == [4, 6]
    assert (
        result["summary"]["requests"]["completed"] == 2
        and result["summary"]["requests"]["length_mismatches"] == 0
    )
    assert result["summary"]["ttft_s"]["count"] == 2  # the role-only first chunk is not a token


async def test_text_prompts_and_chat_rendering_of_trajectories(stub: StubServer, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", agents=1, rounds=[(12, 3), (4, 2)])
    await replay(stub.url, trace, tmp_path, prompt_format="text", text_unit="char")
    assert [len(b["prompt"]) for b in stub.bodies] == [12, 12 + 3 + 4]
    assert stub.bodies[1]["prompt"].startswith(stub.bodies[0]["prompt"])
    stub.bodies.clear()
    await replay(stub.url, trace, tmp_path, endpoint="chat", text_unit="word")
    roles = [m["role"] for m in stub.bodies[1]["messages"]]
    assert (
        roles == ["user", "assistant", "user"] and len(stub.bodies[1]["messages"][0]["content"].split()) == 12
    )


async def test_concurrency_limit(tmp_path: Path) -> None:
    server = StubServer(token_delay_s=0.01)
    await server.start()
    try:
        trace = write_trace(tmp_path / "t.jsonl", agents=6, rounds=[(20, 4), (5, 4)])
        result = await replay(server.url, trace, tmp_path, max_concurrency=2)
    finally:
        await server.stop()
    assert server.max_inflight == 2
    assert result["summary"]["requests"]["completed"] == 12
    assert result["summary"]["queue_s"]["max"] > 0  # agents waited for a slot


async def test_online_poisson_arrivals_cycle_the_trace(stub: StubServer, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", agents=2, rounds=[(20, 2)])
    result = await replay(
        stub.url, trace, tmp_path, mode="online", arrivals="poisson", rate=40.0, duration_s=0.5, seed=3
    )
    meta = result["meta"]
    assert meta["stop_reason"] == "completed" and meta["sessions_started"] > 2
    assert result["summary"]["requests"]["completed"] == meta["sessions_started"]
    assert max(r["t_start_s"] for r in result["requests"]) <= 0.5 + 0.25
    prompts = {tuple(b["prompt"]) for b in stub.bodies}
    assert len(prompts) == meta["sessions_started"]  # cycled agents get fresh content
    assert result["window"] is not None


async def test_online_stops_when_ttft_is_steady(tmp_path: Path) -> None:
    server = StubServer(token_delay_s=0.002)
    await server.start()
    try:
        trace = write_trace(tmp_path / "t.jsonl", agents=4, rounds=[(30, 3), (10, 3)])
        result = await replay(
            server.url,
            trace,
            tmp_path,
            mode="online",
            arrivals="poisson",
            rate=40.0,
            duration_s=60.0,
            steady_window_s=1.0,
            steady_lag_s=1.0,
            steady_tolerance=0.9,
        )
    finally:
        await server.stop()
    assert result["meta"]["stop_reason"] == "steady"
    assert result["meta"]["duration_s"] < 60.0
    assert result["window"]["requests"]["completed"] > 0


async def test_mooncake_slice_time_and_length_scaled(stub: StubServer, tmp_path: Path) -> None:
    result = await replay(
        stub.url,
        MOONCAKE,
        tmp_path,
        mode="online",
        arrivals="trace",
        limit=30,
        time_scale=0.01,
        length_scale=0.02,
        max_context=400,
    )
    recs = result["requests"]
    assert result["summary"]["requests"]["completed"] == 30 and result["meta"]["format"] == "mooncake"
    assert all(r["client_prompt_tokens"] + r["max_tokens"] <= 400 for r in recs)
    assert max(r["t_start_s"] for r in recs) >= 0.09 * 0.999  # last arrival: 9 s of trace time, scaled
    later = [r for r in recs if r["t_start_s"] > 0.05]
    assert all(r["ideal_cached_tokens"] >= 10 for r in later)  # every request shares hash id 0
    assert all(r["cached_tokens"] >= 0 for r in recs)


async def test_ctrl_c_writes_partial_results(tmp_path: Path) -> None:
    server = StubServer(token_delay_s=0.02)
    await server.start()
    out = tmp_path / "partial.json"
    trace = write_trace(tmp_path / "t.jsonl", agents=2, rounds=[(20, 10)] * 50)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadgen",
        "replay",
        "--url",
        server.url,
        "--trace",
        str(trace),
        "--out",
        str(out),
        "--progress",
        "plain",
        "--progress-interval-s",
        "0.2",
        "--vocab-size",
        "256",
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        while True:
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, "replay exited before making progress"
            if "done=" in line and int(line.split("done=")[1].split()[0]) >= 4:
                break
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop()
    assert rc == 130
    result = load_result(out)
    assert result["meta"]["interrupted"] and result["meta"]["stop_reason"] == "interrupted"
    assert result["summary"]["requests"]["completed"] >= 4
    assert result["summary"]["requests"]["cancelled"] >= 1
    assert result["summary"]["requests"]["completed"] < 100


async def test_online_stops_when_ttft_exceeds_the_slo(tmp_path: Path) -> None:
    server = StubServer(token_delay_s=0.05)
    await server.start()
    try:
        trace = write_trace(tmp_path / "t.jsonl", agents=4, rounds=[(30, 2)] * 3)
        result = await replay(
            server.url,
            trace,
            tmp_path,
            mode="online",
            rate=50.0,
            duration_s=60.0,
            ttft_slo_s=0.01,
            stop_on_slo=True,
            stop_when_steady=False,
            steady_window_s=0.5,
        )
    finally:
        await server.stop()
    assert result["meta"]["stop_reason"] == "ttft_slo_exceeded"
    assert result["summary"]["slo"]["per_request_attainment"] == 0.0


async def test_online_needs_arrival_times_or_a_rate(stub: StubServer, tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", agents=1, rounds=[(5, 1)])
    with pytest.raises(ValueError, match="no arrival times: pass --rate"):
        await replay(stub.url, trace, tmp_path, mode="online")
    limited = await replay(stub.url, trace, tmp_path, mode="online", rate=100.0, agents=5)
    assert limited["meta"]["sessions_started"] == 5 and limited["summary"]["requests"]["completed"] == 5

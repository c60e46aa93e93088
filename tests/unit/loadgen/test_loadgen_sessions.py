"""Synthetic content and session scripts: deterministic prefixes, history, context limits, cycling."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from loadgen.config import ReplayConfig
from loadgen.content import Vocab, mix, render_text, token_ids
from loadgen.plan import poisson_arrivals, session_source
from loadgen.sessions import (
    BlockCacheModel,
    BlockScript,
    CallOutput,
    RenderOptions,
    TrajectoryScript,
    scaled_block_request,
)
from loadgen.trace import BlockRequest, BlockTrace, Round, Trajectory, TrajectoryTrace

VOCAB = Vocab(256, 0)


def test_token_ids_are_a_pure_function_of_key_and_position() -> None:
    a = token_ids(42, 1000, VOCAB)
    assert a.dtype == np.int32 and np.array_equal(a, token_ids(42, 1000, VOCAB))
    assert np.array_equal(a[:10], token_ids(42, 10, VOCAB))  # a shorter run is a prefix
    assert np.array_equal(a[500:], token_ids(42, 500, VOCAB, start=500))
    assert not np.array_equal(a[:50], token_ids(43, 50, VOCAB))
    assert a.min() >= 0 and a.max() < 256 and len(np.unique(a)) > 200
    shifted = token_ids(42, 1000, Vocab(10, 100))
    assert shifted.min() >= 100 and shifted.max() < 110
    assert mix(1, 2) != mix(2, 1) and mix(1, 2) == mix(1, 2)


def test_render_text() -> None:
    ids = np.array([0, 1, 25, 26], dtype=np.int32)
    assert render_text(ids, "char") == "abza"
    assert len(render_text(ids, "word").split()) == 4
    with pytest.raises(ValueError, match="unknown text unit"):
        render_text(ids, "emoji")


def prompt(request: object) -> np.ndarray:
    return np.asarray(request.payload["prompt"])  # type: ignore[attr-defined]


def test_trajectory_prompts_extend_with_placeholders_and_end_at_max_context() -> None:
    traj = Trajectory("a", 9, [Round(30, 4), Round(10, 2, tool_latency_s=0.5), Round(50, 8)])
    script = TrajectoryScript(traj, "s-a", RenderOptions(vocab=VOCAB, max_context=100, salt=3))
    first = script.next_call(None)
    assert first is not None and len(prompt(first)) == 30 and first.ideal_cached_tokens == 0
    second = script.next_call(CallOutput(ok=True, text="whatever"))
    assert second is not None and second.tool_latency_s == 0.5
    p1, p2 = prompt(first), prompt(second)
    assert len(p2) == 30 + 4 + 10 and np.array_equal(p2[:30], p1)
    assert second.ideal_cached_tokens == 30 and second.prompt_tokens == 44 and second.max_tokens == 2
    # the third turn would need 44 + 2 + 50 + 8 = 104 > 100 tokens: the trajectory ends
    assert script.next_call(CallOutput(ok=True)) is None
    # the same agent with another salt gets other content
    other = TrajectoryScript(traj, "s-a", RenderOptions(vocab=VOCAB, salt=4)).next_call(None)
    assert other is not None and not np.array_equal(prompt(other), p1)


def test_history_output_without_token_ids_falls_back_to_placeholders() -> None:
    traj = Trajectory("a", 9, [Round(8, 3), Round(2, 1)])
    script = TrajectoryScript(traj, "s", RenderOptions(vocab=VOCAB, history="output"))
    script.next_call(None)
    nxt = script.next_call(CallOutput(ok=True, text="xyz", token_ids=None))
    assert nxt is not None and len(prompt(nxt)) == 8 + 3 + 2
    assert script.history_fallbacks == 1 and nxt.ideal_cached_tokens == 8


def test_chat_rendering_of_a_trajectory_uses_the_actual_output_text() -> None:
    traj = Trajectory("a", 9, [Round(3, 3), Round(2, 1)])
    script = TrajectoryScript(traj, "s", RenderOptions(endpoint="chat", text_unit="char", history="output"))
    script.next_call(None)
    nxt = script.next_call(CallOutput(ok=True, text="OUT"))
    assert nxt is not None and nxt.ideal_cached_tokens is None
    messages = nxt.payload["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "OUT" and len(messages[0]["content"]) == 3


def test_block_requests_share_exactly_their_common_hash_prefix() -> None:
    cache = BlockCacheModel()
    opts = RenderOptions(vocab=VOCAB, length_scale=1 / 32)  # 512-token blocks become 16 tokens
    a = BlockScript(BlockRequest(0, 1500, 64, (0, 1, 2)), "r0", opts, cache=cache).next_call(None)
    b = BlockScript(BlockRequest(1, 1100, 32, (0, 1, 7)), "r1", opts, cache=cache).next_call(None)
    assert a is not None and b is not None
    pa, pb = prompt(a), prompt(b)
    assert (len(pa), len(pb), a.max_tokens, b.max_tokens) == (47, 34, 2, 1)
    assert np.array_equal(pa[:32], pb[:32]) and not np.array_equal(pa[32:34], pb[32:34])
    assert (a.ideal_cached_tokens, b.ideal_cached_tokens) == (0, 32)


def test_scaled_block_request_limits() -> None:
    req = BlockRequest(0, 1030, 400, (1, 2, 3))
    assert scaled_block_request(req, 1.0, 0) == (512, 1030, 400)
    assert scaled_block_request(req, 0.5, 0) == (256, 515, 200)
    _block, prompt_len, gen = scaled_block_request(req, 1.0, 1000)
    assert gen == 250 and prompt_len == 750 and prompt_len + gen <= 1000  # prefix kept, output clipped


def config(**kw: object) -> ReplayConfig:
    fields = {"url": "http://x", "trace": "t", "vocab_size": 256, **kw}
    return ReplayConfig(**fields)  # type: ignore[arg-type]


def test_session_source_slices_scales_and_cycles() -> None:
    trace = TrajectoryTrace(
        [
            Trajectory(f"a{i}", i, [Round(100, 10), Round(50, 20), Round(5, 5)], arrival_s=i * 2.0)
            for i in range(4)
        ]
    )
    source = session_source(
        trace, config(skip=1, limit=2, length_scale=0.5, max_turns=2, time_scale=0.5), 5, "run"
    )
    assert source.size == 2 and source.calls_per_pass == 4
    s0, s2 = source.make(0), source.make(2)  # index 2 is the first agent again, in a second cycle
    assert s0.session_id == "run-a1" and s2.session_id == "run-a1~1"
    r0, r2 = s0.next_call(None), s2.next_call(None)
    assert r0 is not None and r2 is not None and len(prompt(r0)) == 50 and r0.max_tokens == 5
    assert not np.array_equal(prompt(r0), prompt(r2))
    assert s0.next_call(CallOutput(ok=True)) is not None and s0.next_call(CallOutput(ok=True)) is None
    assert source.trace_arrival_s(0) == 1.0 and source.trace_arrival_s(1) == 2.0
    assert source.trace_arrival_s(2) > source.trace_arrival_s(1)


def test_block_source_and_poisson_arrivals() -> None:
    trace = BlockTrace([BlockRequest(float(i), 600, 10, (0, i + 1)) for i in range(3)])
    source = session_source(trace, config(), 1, "r")
    assert [source.make(i).session_id for i in range(3)] == ["r-r0", "r-r1", "r-r2"]
    at = poisson_arrivals(10.0, seed=1)
    times = [at(i) for i in range(2000)]
    assert times == sorted(times) and at(5) == times[5]
    assert 2000 / times[-1] == pytest.approx(10.0, rel=0.1)
    assert dataclasses.replace(source.opts, salt=2).salt == 2

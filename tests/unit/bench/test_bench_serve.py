"""`kvpath bench serve`'s accounting: requests, the verdict per request, per-token ITL, the steady window and
the summary (the client's own accounting is tested in tests/unit/loadgen/test_loadgen_client.py)."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.bench.serve import (
    ServeBenchConfig,
    bench_requests,
    itl_samples,
    judge,
    steady_window,
    summarize,
)
from loadgen.metrics import CallRecord


def record(start: float, chunks: list[tuple[float, int]], end: float, usage: int = -1) -> CallRecord:
    r = CallRecord("s", 0, start, start, max_tokens=0)
    r.chunk_times_s = [t for t, _ in chunks]
    r.chunk_tokens = [n for _, n in chunks]
    r.output_tokens = usage if usage >= 0 else sum(r.chunk_tokens)
    r.t_first_s = r.chunk_times_s[0] if chunks else None
    r.t_end_s = end
    return r


def test_requests_are_reproducible_and_share_the_asked_prefix() -> None:
    cfg = ServeBenchConfig(url="u", num_requests=3, prompt_tokens=6, shared_prefix_tokens=4, max_tokens=9)
    first, again = bench_requests(cfg), bench_requests(cfg)
    assert [r.payload for r in first] == [r.payload for r in again]
    prompts = [r.payload["prompt"] for r in first]
    assert all(len(p) == 6 and p[:4] == prompts[0][:4] for p in prompts)
    assert all(32 <= t < 127 for p in prompts for t in p)
    assert {r.max_tokens for r in first} == {9} and len({r.session_id for r in first}) == 3


def test_coalesced_chunks_count_every_token_and_split_the_gap() -> None:
    rec = record(0.0, [(0.5, 1), (0.8, 3)], end=1.0, usage=4)
    np.testing.assert_allclose(itl_samples(rec), [0.1, 0.1, 0.1])  # 0.3 s over 3 tokens
    failed = CallRecord("s", 0, 0.0, 0.0, max_tokens=4)
    failed.error = "HTTP 500: boom"
    out = summarize([rec, failed], duration_s=2.0)
    assert (out["num_ok"], out["num_failed"], out["first_error"]) == (1, 1, "HTTP 500: boom")
    assert out["output_tokens_per_s"] == 2.0 and out["tokens_per_chunk"] == 2.0
    assert out["ttft_ms"]["p50"] == pytest.approx(500.0) and out["e2e_s"]["p50"] == 1.0


def test_judge_names_the_status_of_a_refusal_and_checks_exact_lengths() -> None:
    cfg = ServeBenchConfig(url="u", max_tokens=4)
    refused = CallRecord("s", 0, 0.0, 0.0, max_tokens=4)
    refused.status, refused.error = 400, "model 'x' not found"
    assert judge(refused, cfg).error == "HTTP 400: model 'x' not found"
    short = record(0.0, [(0.1, 1), (0.2, 2)], end=0.3)
    assert judge(short, cfg).error == "got 3 tokens, expected 4"
    openai_only = record(0.0, [(0.1, 1), (0.2, 1)], end=0.3, usage=3)
    assert judge(openai_only, ServeBenchConfig(url="u", max_tokens=4, openai_only=True)).error is None


def test_steady_window_spans_the_time_every_slot_streams() -> None:
    a = record(0.0, [(0.1, 1), (0.5, 1), (0.9, 1)], end=1.0)
    b = record(0.05, [(0.2, 1), (0.6, 2), (0.8, 1)], end=0.85)
    start, end, tokens = steady_window([a, b], concurrency=2)
    assert (start, end) == (0.2, 0.8) and tokens == 1 + 2 + 1  # chunks in (0.2, 0.8]
    out = summarize([a, b], duration_s=1.0, concurrency=2)
    assert out["steady_window_s"] == pytest.approx([0.2, 0.8])
    assert out["steady_tokens_per_s"] == pytest.approx(4 / 0.6)
    b.error = "boom"
    assert steady_window([a, b], concurrency=2) == (0.0, 0.0, 0)

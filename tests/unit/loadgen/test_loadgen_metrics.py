"""Metrics math against hand-computed cases."""

from __future__ import annotations

import pytest

from loadgen.metrics import CallRecord, distribution, hit_rates, is_steady, session_slo_attainment, summarize


def rec(
    session: str,
    turn: int,
    start: float,
    first: float,
    last: float,
    end: float,
    out: int,
    *,
    second: float | None = None,
    prompt: int = 100,
    cached: int | None = None,
    error: str | None = None,
) -> CallRecord:
    r = CallRecord(
        session,
        turn,
        start,
        start,
        out,
        t_first_s=first,
        t_second_s=second,
        t_last_token_s=last,
        t_end_s=end,
        output_tokens=out,
        prompt_tokens=prompt,
        cached_tokens=cached,
    )
    if error:
        r.error, r.error_code, r.t_end_s = error, error, None
    return r


def test_distribution_by_hand() -> None:
    d = distribution([4.0, 1.0, None, 3.0, 2.0])
    assert d["count"] == 4 and d["mean"] == 2.5 and d["min"] == 1.0 and d["max"] == 4.0
    assert d["p50"] == 2.5  # linear interpolation between 2 and 3
    assert d["p90"] == pytest.approx(3.7) and d["p99"] == pytest.approx(3.97)
    assert distribution([])["p50"] is None


def test_per_request_latencies() -> None:
    r = rec("s", 0, start=1.0, first=1.5, second=1.6, last=2.4, end=2.5, out=10)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.ttst_s == pytest.approx(0.1)
    assert r.tpot_s == pytest.approx(0.9 / 9)
    assert r.e2e_s == pytest.approx(1.5)
    single = rec("s", 0, start=0.0, first=0.2, last=0.2, end=0.3, out=1)
    assert single.tpot_s is None and single.ttst_s is None
    assert single.meets_slo(0.25, 0.001) and not single.meets_slo(0.1, 1.0)


def test_hit_rates_token_weighted_per_turn() -> None:
    records = [
        rec("a", 0, 0, 1, 1, 1, 1, prompt=100, cached=0),
        rec("a", 1, 0, 1, 1, 1, 1, prompt=200, cached=150),
        rec("b", 1, 0, 1, 1, 1, 1, prompt=100, cached=100),
        rec("b", 2, 0, 1, 1, 1, 1, prompt=300, cached=None),  # server reported nothing: not counted
    ]
    records[1].ideal_cached_tokens, records[1].client_prompt_tokens = 180, 200
    h = hit_rates(records)
    assert h["overall"] == pytest.approx(250 / 400)
    assert h["from_turn_2"] == pytest.approx(250 / 300)
    assert h["ideal_from_turn_2"] == pytest.approx(0.9)
    turns = {p["turn"]: p for p in h["per_turn"]}
    assert turns[2]["hit_rate"] == pytest.approx(250 / 300) and turns[2]["requests"] == 2
    assert turns[3]["hit_rate"] is None and turns[3]["requests"] == 1


def test_session_slo_is_all_rounds_ttft_and_mean_itl() -> None:
    records = [
        # session a: TTFTs 0.1 and 0.2, ITL (0.9 + 0.1) / (10 + 1) < 0.1 -> meets (0.3 s, 0.1 s)
        rec("a", 0, 0.0, 0.1, 1.0, 1.0, 11),
        rec("a", 1, 2.0, 2.2, 2.3, 2.3, 2),
        # session b: one slow first token
        rec("b", 0, 0.0, 0.5, 0.6, 0.6, 2),
        # session c: fast first tokens but slow decode on average
        rec("c", 0, 0.0, 0.1, 2.1, 2.1, 3),
    ]
    assert session_slo_attainment(records, 0.3, 0.1) == pytest.approx(1 / 3)
    s = summarize(records, arrivals_s={"a": 0.0, "b": 0.0, "c": 0.0}, ttft_slo_s=0.3, tpot_slo_s=0.1)
    # per request: a0 (tpot 0.09), a1 (tpot 0.1) and the b/c requests fail on TTFT / TPOT
    assert s["slo"]["per_request_attainment"] == pytest.approx(2 / 4)
    assert s["slo"]["per_session_attainment"] == pytest.approx(1 / 3)
    span = 2.3
    assert s["throughput"]["duration_s"] == pytest.approx(span)
    assert s["slo"]["goodput_requests_per_s"] == pytest.approx(2 / span)
    assert s["slo"]["goodput_output_tokens_per_s"] == pytest.approx(13 / span)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(18 / span)
    assert s["throughput"]["input_tokens_per_s"] == pytest.approx(400 / span)


def test_summary_counts_failures_cancellations_and_jct() -> None:
    records = [
        rec("a", 0, 0.0, 0.1, 0.5, 0.5, 3),
        rec("a", 1, 0.5, 0.7, 1.5, 1.6, 4),
        rec("b", 0, 0.2, 0.3, 0.4, 0.4, 2),
        rec("b", 1, 0.4, 0.5, 0.5, 0.5, 2, error="http_503"),
        rec("c", 0, 1.0, 1.0, 1.0, 1.0, 2, error="cancelled"),
    ]
    records[1].output_tokens = 3  # the server returned fewer tokens than asked
    s = summarize(records, arrivals_s={"a": 0.0, "b": 0.2, "c": 1.0}, ttft_slo_s=1.0, tpot_slo_s=1.0)
    assert s["requests"] == {
        "total": 4,
        "completed": 3,
        "failed": 1,
        "cancelled": 1,
        "errors": {"http_503": 1},
        "length_mismatches": 1,
    }
    assert s["jct"]["all_agents_s"] == pytest.approx(1.6)
    assert s["jct"]["per_agent_s"]["count"] == 1 and s["jct"]["per_agent_s"]["max"] == pytest.approx(1.6)
    assert s["slo"]["per_request_attainment"] == pytest.approx(3 / 4)
    assert s["ttft_s"]["count"] == 3


def test_steady_state_rule() -> None:
    samples = [(t / 10, 1.0) for t in range(0, 100)]  # one request every 0.1 s, TTFT 1.0
    assert not is_steady(samples, 2.5, window_s=1.0, lag_s=3.0, tolerance=0.05)  # too early for the lag
    assert is_steady(samples, 9.0, window_s=1.0, lag_s=3.0, tolerance=0.05)
    drifting = [(t / 10, 1.0 + t / 100) for t in range(0, 100)]  # TTFT grows 0.1 per second
    assert not is_steady(drifting, 9.0, window_s=1.0, lag_s=3.0, tolerance=0.05)
    assert is_steady(drifting, 9.0, window_s=1.0, lag_s=3.0, tolerance=0.25)
    assert not is_steady(samples[:3], 9.0, window_s=1.0, lag_s=3.0, tolerance=0.5)  # too few samples

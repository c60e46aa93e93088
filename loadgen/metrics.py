"""Serving metrics from per-request records (pure functions; times in seconds from the run start).

Per request: TTFT = first token - send; TTST = second token - first token (DualPath's time to second token,
the PE -> DE handoff in a disaggregated system); TPOT = (last token - first token) / (output tokens - 1);
ITL = the gaps between successive token-bearing stream chunks; E2E = end of stream - send.
JCT: per agent, last response - arrival; for an offline run, the time until every agent is done.
Hit rate: server-reported cached prompt tokens over prompt tokens, token-weighted, per turn and overall.
SLO: a request meets it when TTFT <= ttft_slo and TPOT <= tpot_slo (single-token outputs have no TPOT); a
session meets AMPD's default when every round's TTFT <= ttft_slo and its mean ITL <= tpot_slo (brief §6.2).
Goodput: requests (and their output tokens) that meet the SLO, per second.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
_IN_MEMORY_ONLY = ("itl_s", "chunk_times_s", "chunk_tokens")


@dataclass(slots=True)
class CallRecord:
    session_id: str
    turn: int
    t_ready_s: float  # the agent was ready to send (client-side queueing ends at t_start_s)
    t_start_s: float
    max_tokens: int
    t_first_s: float | None = None
    t_second_s: float | None = None
    t_last_token_s: float | None = None
    t_end_s: float | None = None
    output_tokens: int = 0  # usage.completion_tokens, else the tokens of the token-bearing chunks
    token_chunks: int = 0
    prompt_tokens: int | None = None  # server-reported
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    client_prompt_tokens: int | None = None
    ideal_cached_tokens: int | None = None
    status: int = 0
    error: str | None = None
    error_code: str | None = None
    itl_max_s: float | None = None
    # kept in memory, not in the result JSON: the gaps between token-bearing chunks, and each such chunk's
    # arrival time and token count (its token ids when the server sends them, else 1)
    itl_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and self.t_end_s is not None and self.t_first_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_s is None else self.t_first_s - self.t_start_s

    @property
    def ttst_s(self) -> float | None:
        if self.t_second_s is None or self.t_first_s is None:
            return None
        return self.t_second_s - self.t_first_s

    @property
    def tpot_s(self) -> float | None:
        if self.t_first_s is None or self.t_last_token_s is None or self.output_tokens < 2:
            return None
        return (self.t_last_token_s - self.t_first_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.t_end_s is None else self.t_end_s - self.t_start_s

    @property
    def hit_rate(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens

    def meets_slo(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        ttft, tpot = self.ttft_s, self.tpot_s
        return self.ok and ttft is not None and ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in _IN_MEMORY_ONLY:
            del out[key]
        for key in ("ttft_s", "ttst_s", "tpot_s", "e2e_s"):
            out[key] = getattr(self, key)
        return out


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """count, mean, min, max and percentiles (linear interpolation) of the non-None values."""
    arr = np.fromiter((v for v in values if v is not None), dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}, "min": None, "max": None}
    pcts = np.percentile(arr, PERCENTILES)
    out: dict[str, float | int | None] = {"count": int(arr.size), "mean": float(arr.mean())}
    out.update({f"p{q}": float(v) for q, v in zip(PERCENTILES, pcts, strict=True)})
    out.update({"min": float(arr.min()), "max": float(arr.max())})
    return out


def hit_rates(records: Sequence[CallRecord]) -> dict[str, Any]:
    """Token-weighted cached/prompt overall, from turn 2 on, and per turn; with the client-side ideal."""
    per_turn: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])  # n, cached, prompt, ideal, client
    for r in records:
        if not r.ok:
            continue
        acc = per_turn[r.turn]
        acc[0] += 1
        if r.cached_tokens is not None and r.prompt_tokens:
            acc[1] += r.cached_tokens
            acc[2] += r.prompt_tokens
        if r.ideal_cached_tokens is not None and r.client_prompt_tokens:
            acc[3] += r.ideal_cached_tokens
            acc[4] += r.client_prompt_tokens

    def ratio(turns: Iterable[int], num: int, den: int) -> float | None:
        top = sum(per_turn[t][num] for t in turns)
        bottom = sum(per_turn[t][den] for t in turns)
        return top / bottom if bottom else None

    turns = sorted(per_turn)
    later = [t for t in turns if t >= 1]
    return {
        "overall": ratio(turns, 1, 2),
        "from_turn_2": ratio(later, 1, 2),
        "ideal_overall": ratio(turns, 3, 4),
        "ideal_from_turn_2": ratio(later, 3, 4),
        "per_turn": [
            {
                "turn": t + 1,
                "requests": per_turn[t][0],
                "hit_rate": ratio([t], 1, 2),
                "ideal_hit_rate": ratio([t], 3, 4),
            }
            for t in turns
        ],
    }


def session_slo_attainment(
    records: Sequence[CallRecord], ttft_slo_s: float, itl_slo_s: float
) -> float | None:
    """AMPD default: share of sessions whose every round meets TTFT and whose mean ITL meets the ITL SLO."""
    by_session: dict[str, list[CallRecord]] = defaultdict(list)
    for r in records:
        by_session[r.session_id].append(r)
    if not by_session:
        return None
    met = 0
    for calls in by_session.values():
        if not all(c.ok and (c.ttft_s or 0.0) <= ttft_slo_s for c in calls):
            continue
        spans = sum((c.t_last_token_s or 0.0) - (c.t_first_s or 0.0) for c in calls if c.output_tokens > 1)
        gaps = sum(c.output_tokens - 1 for c in calls if c.output_tokens > 1)
        met += int(gaps == 0 or spans / gaps <= itl_slo_s)
    return met / len(by_session)


def jct(records: Sequence[CallRecord], arrivals_s: dict[str, float]) -> dict[str, Any]:
    """Per-agent completion times of finished agents, and the time until the last agent finished."""
    last_end: dict[str, float] = {}
    failed: set[str] = set()
    for r in records:
        if not r.ok:
            failed.add(r.session_id)
        elif r.t_end_s is not None:
            last_end[r.session_id] = max(last_end.get(r.session_id, 0.0), r.t_end_s)
    done = {s: t - arrivals_s.get(s, 0.0) for s, t in last_end.items() if s not in failed}
    return {
        "all_agents_s": max(last_end.values()) if last_end else None,
        "per_agent_s": distribution(done.values()),
    }


def summarize(
    records: Sequence[CallRecord],
    *,
    arrivals_s: dict[str, float],
    ttft_slo_s: float,
    tpot_slo_s: float,
    itl_samples: Sequence[float] = (),
) -> dict[str, Any]:
    """Everything the result JSON's `summary` holds, from the records of one run (or one window of it).

    Requests cancelled by the end of the run (Ctrl-C, a steady-state stop) are counted, not judged.
    """
    cancelled = sum(1 for r in records if r.error_code == "cancelled")
    records = [r for r in records if r.error_code != "cancelled"]
    ok = [r for r in records if r.ok]
    ends = [r.t_end_s for r in ok if r.t_end_s is not None]
    span = (max(ends) - min(r.t_start_s for r in records)) if ends else 0.0
    return {
        "requests": _request_counts(records, ok, cancelled),
        "sessions": len({r.session_id for r in records}),
        "ttft_s": distribution(r.ttft_s for r in ok),
        "ttst_s": distribution(r.ttst_s for r in ok),
        "tpot_s": distribution(r.tpot_s for r in ok),
        "itl_s": distribution(itl_samples),
        "e2e_s": distribution(r.e2e_s for r in ok),
        "queue_s": distribution(r.t_start_s - r.t_ready_s for r in records),
        "jct": jct(records, arrivals_s),
        **_throughput(ok, span),
        "hit_rate": hit_rates(records),
        "slo": _slo(records, ok, span, ttft_slo_s, tpot_slo_s),
    }


def _per_s(amount: float, span_s: float) -> float | None:
    return amount / span_s if span_s > 0 else None


def _request_counts(
    records: Sequence[CallRecord], ok: Sequence[CallRecord], cancelled: int
) -> dict[str, Any]:
    return {
        "total": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "cancelled": cancelled,
        "errors": dict(Counter(r.error_code or "error" for r in records if not r.ok)),
        "length_mismatches": sum(1 for r in ok if r.output_tokens != r.max_tokens),
    }


def _throughput(ok: Sequence[CallRecord], span_s: float) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens or r.client_prompt_tokens or 0 for r in ok)
    output = sum(r.output_tokens for r in ok)
    return {
        "throughput": {
            "duration_s": span_s,
            "requests_per_s": _per_s(len(ok), span_s),
            "input_tokens_per_s": _per_s(prompt, span_s),
            "output_tokens_per_s": _per_s(output, span_s),
            "total_tokens_per_s": _per_s(prompt + output, span_s),
        },
        "tokens": {"prompt": prompt, "cached": sum(r.cached_tokens or 0 for r in ok), "output": output},
    }


def _slo(
    records: Sequence[CallRecord],
    ok: Sequence[CallRecord],
    span_s: float,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> dict[str, Any]:
    good = [r for r in ok if r.meets_slo(ttft_slo_s, tpot_slo_s)]
    return {
        "ttft_s": ttft_slo_s,
        "tpot_s": tpot_slo_s,
        "per_request_attainment": len(good) / len(records) if records else None,
        "per_session_attainment": session_slo_attainment(records, ttft_slo_s, tpot_slo_s),
        "goodput_requests_per_s": _per_s(len(good), span_s),
        "goodput_output_tokens_per_s": _per_s(sum(r.output_tokens for r in good), span_s),
    }


def window_mean(samples: Sequence[tuple[float, float]], lo_s: float, hi_s: float) -> tuple[float | None, int]:
    values = [v for t, v in samples if lo_s <= t < hi_s]
    return (sum(values) / len(values) if values else None), len(values)


def is_steady(
    samples: Sequence[tuple[float, float]],
    now_s: float,
    *,
    window_s: float,
    lag_s: float,
    tolerance: float,
    min_samples: int = 5,
) -> bool:
    """DualPath's steady state: mean TTFT of the last window within `tolerance` of the window `lag_s` earlier.

    `samples` are (send time, TTFT) of finished requests. False until both windows hold `min_samples`.
    """
    if now_s < lag_s + window_s:
        return False
    recent, n_recent = window_mean(samples, now_s - window_s, now_s)
    earlier, n_earlier = window_mean(samples, now_s - lag_s - window_s, now_s - lag_s)
    if recent is None or earlier is None or n_recent < min_samples or n_earlier < min_samples or earlier <= 0:
        return False
    return abs(recent - earlier) / earlier < tolerance

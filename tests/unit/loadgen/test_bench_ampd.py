"""`kvpath bench ampd`'s SLO attainment: a session meets its SLO when every round succeeded under the TTFT
SLO and its mean ITL over all its tokens is under the ITL SLO."""

from __future__ import annotations

from typing import Any

from loadgen.bench.ampd import session_attainment


def rec(
    session: str, ttft: float | None, first: float, last: float, tokens: int, error: str | None = None
) -> dict[str, Any]:
    return {
        "session_id": session, "ttft_s": ttft, "t_first_s": first, "t_last_token_s": last,
        "output_tokens": tokens, "error": error,
    }  # fmt: skip


def test_session_attainment() -> None:
    requests = [
        rec("ok", 0.1, 1.0, 1.9, 10),
        rec("ok", 0.2, 5.0, 5.9, 10),  # 0.1 s per token
        rec("slow-ttft", 0.1, 1.0, 1.1, 2),
        rec("slow-ttft", 0.6, 3.0, 3.1, 2),
        rec("slow-itl", 0.1, 1.0, 3.0, 5),  # 0.5 s per token
        rec("failed", None, 0.0, 0.0, 0, error="overloaded"),
        rec("one-token", 0.1, 1.0, 1.0, 1),
    ]
    assert session_attainment(requests, ttft_slo_s=0.5, itl_slo_s=0.2) == 2 / 5
    assert session_attainment([], 1.0, 1.0) == 0.0

"""`stats`: hand-computed cases for each trace shape, and the published averages of the Mooncake trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.formats import load_trace
from loadgen.stats import trace_stats
from loadgen.trace import (
    BlockRequest,
    BlockTrace,
    MessagesCall,
    MessagesSession,
    MessagesTrace,
    Round,
    Trajectory,
    TrajectoryTrace,
)

MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")


def test_trajectory_stats_by_hand() -> None:
    trace = TrajectoryTrace(
        [
            Trajectory("a", 1, [Round(10, 2), Round(4, 3), Round(6, 1)]),  # contexts 0, 12, 19
            Trajectory("b", 2, [Round(20, 5)]),
        ]
    )
    s = trace_stats(trace)
    assert s["requests"] == 4 and s["trajectories"] == 2
    assert s["input_mean"] == pytest.approx((10 + 16 + 25 + 20) / 4)
    assert s["output_mean"] == pytest.approx(11 / 4)
    assert s["turns"] == 2
    assert s["append"] == pytest.approx((20 / 3 + 20) / 2)  # per-trajectory means, averaged
    assert s["gen"] == pytest.approx((2 + 5) / 2)
    assert s["total"] == pytest.approx((26 + 25) / 2)
    assert s["context"] == pytest.approx((0 + 12 + 19 + 0) / 4)  # turn-weighted
    assert s["append_pooled"] == 10 and s["max_prompt"] == 25
    assert s["ideal_hit_rate"] == pytest.approx(31 / 71)


def test_block_stats_by_hand() -> None:
    trace = BlockTrace(
        [
            BlockRequest(0.0, 10, 1, (1, 2, 3)),  # 4 + 4 + 2 tokens, nothing seen yet
            BlockRequest(
                1.0, 9, 2, (1, 2, 5)
            ),  # two full blocks seen: 8 hits; its partial block never counts
            BlockRequest(4.0, 8, 3, (1, 2)),  # 8 hits
        ],
        block_tokens=4,
    )
    s = trace_stats(trace)
    assert s["requests"] == 3 and s["input_mean"] == 9 and s["output_mean"] == 2
    assert s["ideal_hit_rate"] == pytest.approx(16 / 27)
    assert s["duration_s"] == 4.0 and s["unique_blocks"] == 4


def test_messages_stats_by_hand() -> None:
    system, user = {"role": "system", "content": "abcd"}, {"role": "user", "content": "hello"}
    reply, again = {"role": "assistant", "content": "xyz"}, {"role": "user", "content": "again"}
    trace = MessagesTrace(
        [MessagesSession("s1", [MessagesCall([system, user], 3), MessagesCall([system, user, reply, again])])]
    )
    s = trace_stats(trace, count_tokens=len, default_output_tokens=7)
    # call 1: prompt 9, all new; call 2: prompt 17 of which 9 + the 3-token reply are context
    assert s["token_counts"] == "tokenizer"
    assert (s["requests"], s["input_mean"], s["output_mean"]) == (2, 13, 5)
    assert (s["append"], s["gen"], s["total"], s["context"]) == (7, 5, 24, 6)
    assert s["ideal_hit_rate"] == pytest.approx(12 / 26)
    # an output length missing from the record comes from the reply the next call carries
    trace.sessions[0].calls[0].output_tokens = None
    assert trace_stats(trace, count_tokens=len, default_output_tokens=7)["output_mean"] == 5
    assert trace_stats(trace)["token_counts"] == "estimated"


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared trace not present")
def test_mooncake_trace_reproduces_published_means() -> None:
    s = trace_stats(load_trace(MOONCAKE))
    assert s["requests"] == 12031
    assert s["input_mean"] == pytest.approx(12035, abs=0.5)  # README / FAST'25: 12,035
    assert s["output_mean"] == pytest.approx(343, abs=0.5)  # 343
    assert 0 < s["ideal_hit_rate"] < 1 and s["duration_s"] == pytest.approx(3537, abs=1)

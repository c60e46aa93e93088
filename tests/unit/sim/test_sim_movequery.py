"""`kvpath loadgen sim --sweep movequery`: the paper's tables regenerated from the cost model."""

from __future__ import annotations

import pytest

from loadgen.sim.movequery import (
    BUSY_HOLDER_QUEUE_S,
    CHUNK_TOKENS,
    STEP_S,
    format_movequery,
    movequery_sweep,
)
from loadgen.sim.movequery_memory import _admit_at, _Admitted, timed_fanin
from services.policy.movequery import Primitive, RouteRequest, resident_kv_tokens
from services.policy.movequery_profile import paper_profile


def test_the_papers_tables() -> None:
    result = movequery_sweep()
    decode = [row["256"] for row in result["route_us"].values()]
    assert 27 < min(decode) and max(decode) < 39 and max(decode) / min(decode) < 1.5  # ~31-48 us, within 1.5x
    assert result["bytes_saved"]["256"] == pytest.approx(0.763, abs=5e-4)  # ">= 76% at M_q <= 256"
    assert [round(result["byte_break_even_rows"][c]) for c in ("2048", "512")] == [1080, 270]
    ratios = result["route_over_splice"]
    assert ratios["1024"] == pytest.approx(28, abs=1) and 60 < ratios["256"] < 100
    assert all(3e4 < v < 1.3e5 for v in result["route_fetch_crossover_rows"].values())  # "~1e5"
    local = result["fetch_local_crossover_tokens"]
    assert round(local["1.5"]) == 74 and round(local["0.5"]) == 222  # "75-220 tokens"
    assert 150 < result["host_overhead_crossover_rows"] < 400  # "a few hundred"
    choices = {(c["fabric"], c["request"]): c["choice"] for c in result["choices"]}
    for fabric in result["route_us"]:  # route at decode on every fabric; local for a tiny chunk
        assert choices[(fabric, "decode 1 step, chunk 2048")] == "route"
        assert choices[(fabric, "decode 1 step, chunk 64, no holder")] == "local"
        assert choices[(fabric, "decode 64 steps, no room for the chunk")] == "route"
    assert "byte break-even" in format_movequery(result)


def test_memory_bound_fanin_is_timed_with_the_routers_rule() -> None:
    """64 sub-agents into a requester cache of 3 fetched copies. All at once: fetch and local run 3 at a time,
    route (own tokens only) 11; auto sees the burst (the sub-agents that arrived with each one and are not
    decided yet) and prices each primitive at the waves the whole burst would queue in, so it routes as
    route-all does and is as fast (it trailed route-all by a third when it priced each sub-agent alone). One
    every 4 s to a busy holder: no burst, so auto waits for room for a copy (priced from the release times)
    instead of routing into the holder's queue, as fast as fetch and over 2x faster than route."""
    fan = movequery_sweep()["memory_bound_fanin"]
    for case in ("burst_idle_holder", "burst_busy_holder"):
        burst = fan[case]
        assert [burst[m]["at_once"] for m in ("fetch", "local", "route")] == [3, 3, 11]
        assert burst["auto"]["at_once"] == 11 and burst["auto"]["routed"] >= 48, case
        assert burst["auto"]["latency_p50_s"] <= 1.001 * burst["route"]["latency_p50_s"], case
        assert burst["route"]["latency_p50_s"] < burst["fetch"]["latency_p50_s"] / 1.5
    spaced = fan["spaced_busy_holder"]
    assert spaced["auto"]["routed"] == 0
    assert spaced["auto"]["latency_p50_s"] == spaced["fetch"]["latency_p50_s"]
    assert spaced["auto"]["latency_p50_s"] < spaced["route"]["latency_p50_s"] / 2


def test_a_burst_that_turns_over_fast_keeps_its_copies() -> None:
    """Short answers (32 tokens) to a busy holder, 8 sub-agents at once into a cache of 3 copies: each copy
    is back in well under a routed sub-agent's time, so the burst's waves cost less than routing and auto
    fetches as forced fetch does, all but the burst's last: with no burst left to weigh, a backlog keeps
    copies out (the rule for sub-agents arriving one by one). Pricing copies out of a backlog alone, as the
    rule did before it saw bursts, routed 5 of the 8."""
    req = RouteRequest(CHUNK_TOKENS, 320, 32, holder_queue_s=BUSY_HOLDER_QUEUE_S)
    profile = paper_profile(with_compute=True)
    capacity = 3 * resident_kv_tokens(Primitive.FETCH, req)
    out = timed_fanin(profile, profile.fabric("ibgda"), req, n=8, capacity=capacity, step_s=STEP_S)
    assert out["auto"]["routed"] == 1
    assert out["auto"]["latency_p50_s"] == out["fetch"]["latency_p50_s"] < out["route"]["latency_p50_s"]


def test_a_sub_agent_is_admitted_when_what_it_keeps_fits_beside_those_still_running() -> None:
    running = [_Admitted(0.0, 5.0, 10), _Admitted(0.0, 7.0, 10)]  # (start, end, KV tokens) in a cache of 30
    assert _admit_at(running, 30, 1.0, 10) == 1.0  # fits now
    assert _admit_at(running, 30, 1.0, 15) == 5.0  # once the first gave its 10 back
    assert _admit_at(running, 30, 1.0, 40) == 7.0  # larger than the cache: alone, after both

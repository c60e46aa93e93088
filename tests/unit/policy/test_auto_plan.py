"""The `auto` policy's choice in clear cases (services/policy/auto.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.policy import auto_costs as terms
from services.policy.ampd_costs import Link
from services.policy.auto import (
    LOCAL,
    REMOTE,
    AutoRequest,
    AutoSnapshot,
    EngineLoad,
    Source,
    enumerate_plans,
    plan,
)
from services.policy.auto_costs import AutoProfiles
from tests.unit.policy.test_auto_costs import COSTS, ROUTE

P = AutoProfiles(costs=COSTS, route=ROUTE)


def colo(engine_id: str, node: int = 0, **kw: float) -> EngineLoad:
    return EngineLoad(engine_id, "colocated", node, **kw)  # type: ignore[arg-type]


def test_a_resident_hbm_hit_beats_reading_it_from_storage() -> None:
    snap = AutoSnapshot((colo("e0"), colo("e1")), read_queue_tokens={0: 0})
    req = AutoRequest("r", 4000, storage_hit_tokens=4000, resident_tokens={"e1": 4000})
    decision = plan(req, snap, P)
    assert decision is not None
    assert (decision.chosen.label, decision.chosen.decode_engine) == ("local/hbm", "e1")
    assert decision.runner_up is not None and decision.runner_up.label != "local/hbm"
    assert decision.runner_up.cost_s >= decision.chosen.cost_s


def test_a_long_miss_goes_to_a_prefill_engine_not_onto_a_busy_decode_batch() -> None:
    engines = (EngineLoad("pe0", "prefill", 0), EngineLoad("de0", "decode", 0, num_decoding=16))
    decision = plan(AutoRequest("r", 8000, output_tokens=8), AutoSnapshot(engines), P)
    assert decision is not None
    assert (decision.chosen.where, decision.chosen.prefill_engine) == (REMOTE, "pe0")
    # a short incremental prefill over resident history on a lightly loaded decode engine stays local (AMPD)
    short = AutoRequest("s", 8050, output_tokens=8, resident_tokens={"de0": 8000})
    light = (engines[0], EngineLoad("de0", "decode", 0, num_decoding=1))
    local = plan(short, AutoSnapshot(light), P)
    assert local is not None and (local.chosen.label, local.chosen.prefill_engine) == ("local/hbm", "de0")


def test_a_hot_engine_is_avoided_when_moving_the_kv_is_cheaper() -> None:
    hot, idle = colo("e0", queued_prefill_tokens=20_000), colo("e1")
    req = AutoRequest("r", 2100, pool_hit_tokens=2000, resident_tokens={"e0": 2000})
    decision = plan(req, AutoSnapshot((hot, idle), pool_queue_tokens=0), P)
    assert decision is not None
    assert (decision.chosen.label, decision.chosen.decode_engine) == ("local/pool", "e1")
    # the same engine with no queue keeps the session where its KV is
    stay = plan(req, AutoSnapshot((colo("e0"), idle), pool_queue_tokens=0), P)
    assert stay is not None and (stay.chosen.label, stay.chosen.decode_engine) == ("local/hbm", "e0")


def test_the_storage_read_goes_to_the_shorter_queue_side() -> None:
    fast = AutoProfiles(costs=replace(COSTS, links={**COSTS.links, "storage": Link(1e-3, 1e8)}))
    engines = (EngineLoad("pe0", "prefill", 0), EngineLoad("de1", "decode", 1))
    req = AutoRequest("r", 2100, storage_hit_tokens=2000)
    snap = AutoSnapshot(engines, read_queue_tokens={0: 500_000, 1: 0}, local_on_decode=False)
    decision = plan(req, snap, fast)
    assert decision is not None and decision.chosen.label == "remote/storage-de"
    assert decision.chosen.source_at == "node:1"
    mirrored = AutoSnapshot(engines, read_queue_tokens={0: 0, 1: 500_000}, local_on_decode=False)
    other = plan(req, mirrored, fast)
    assert other is not None and other.chosen.label == "remote/storage"


def test_routing_the_query_to_a_holder_beats_recomputing_a_long_unstored_prefix() -> None:
    req = AutoRequest("r", 6000, output_tokens=4, held_tokens={"h": 5900}, resident_tokens={"h": 5900})
    # the holder decodes 64 streams: prefilling there would stall them; recomputing 5,900 tokens costs more
    holder = colo("h", num_decoding=64)
    decision = plan(req, AutoSnapshot((holder, colo("e1"))), P)
    assert decision is not None
    chosen = decision.chosen
    assert (chosen.source, chosen.decode_engine, chosen.source_at) == (Source.ROUTE, "e1", "h")
    # a holder with a long prefill queue runs it a step (a 2,048-token chunk and its 64 decodes) at a time and
    # the queued exchanges between steps: each of the 2 layers' exchanges waits for one step, not the queue
    busy = colo("h", num_decoding=64, queued_prefill_tokens=50_000)
    routed = plan(req, AutoSnapshot((busy, colo("e1"))), P)
    assert routed is not None and routed.chosen.label == "local/route"
    step = P.costs.prefill_s(0, 2048, "colocated") + P.costs.decode_step_s(64, 0, "colocated")
    assert routed.chosen.ttft_s == pytest.approx(chosen.ttft_s + 2 * step)
    # a short backlog delays the request's exchanges by itself, in all
    short = plan(req, AutoSnapshot((colo("h", num_decoding=64, queued_prefill_s=0.001), colo("e1"))), P)
    assert short is not None and short.chosen.ttft_s == pytest.approx(chosen.ttft_s + 0.001)
    # one step the length of the whole queue (a budget that large) holds every exchange: recompute instead
    whole = colo("h", num_decoding=64, queued_prefill_tokens=50_000, max_num_batched_tokens=50_000)
    avoided = plan(req, AutoSnapshot((whole, colo("e1"))), P)
    assert avoided is not None and avoided.chosen.label == "local/recompute"


def test_the_cheapest_plan_meeting_the_slo_else_the_one_missing_it_least() -> None:
    # a local prefill shares its step with 4 decodes (9 ms): still faster than a remote one and its handoff
    engines = (EngineLoad("pe0", "prefill", 0), EngineLoad("de0", "decode", 0, num_decoding=4))
    req = AutoRequest("r", 1100, output_tokens=4, resident_tokens={"de0": 1000})
    loose = plan(req, AutoSnapshot(engines), P)
    assert loose is not None and loose.chosen.where == REMOTE  # a local prefill would stall 4 decodes
    tight_slo = loose.chosen.ttft_s * 0.99
    tight = plan(
        AutoRequest("r", 1100, output_tokens=4, resident_tokens={"de0": 1000}, ttft_slo_s=tight_slo),
        AutoSnapshot(engines),
        P,
    )
    assert tight is not None and tight.meets_slo and tight.chosen.where == LOCAL
    impossible = plan(AutoRequest("r", 1100, output_tokens=4, ttft_slo_s=1e-6), AutoSnapshot(engines), P)
    assert impossible is not None and not impossible.meets_slo
    fastest = min(
        enumerate_plans(AutoRequest("r", 1100, output_tokens=4), AutoSnapshot(engines), P),
        key=lambda x: x.ttft_s,
    )
    assert impossible.chosen.ttft_s == pytest.approx(fastest.ttft_s)


def test_only_the_paths_the_topology_offers_and_live_engines_are_enumerated() -> None:
    engines = (colo("e0"), colo("e1", is_draining=True), EngineLoad("pe0", "prefill", 0))
    req = AutoRequest("r", 3000, pool_hit_tokens=2000, storage_hit_tokens=2000, resident_tokens={"e0": 500})
    snap = AutoSnapshot(
        engines,
        read_queue_tokens={0: 0},
        pool_queue_tokens=0,
        sources=frozenset({Source.STORAGE, Source.RECOMPUTE}),
    )
    plans = enumerate_plans(req, snap, P)
    assert {x.source for x in plans} == {Source.STORAGE, Source.RECOMPUTE}
    assert {x.decode_engine for x in plans} == {"e0"}
    assert plan(req, AutoSnapshot((EngineLoad("pe0", "prefill", 0),)), P) is None


def test_the_router_calibration_applies_to_every_plan_kind() -> None:
    engines = (EngineLoad("pe0", "prefill", 0), EngineLoad("de0", "decode", 0), colo("h"))
    req = AutoRequest("r", 3000, pool_hit_tokens=2000, storage_hit_tokens=2000, held_tokens={"h": 2900})
    snap = AutoSnapshot(engines, read_queue_tokens={0: 0}, pool_queue_tokens=0)
    raw = enumerate_plans(req, snap, P)
    calibrated = enumerate_plans(req, snap, replace(P, overhead_s=0.1, time_scale=2.0))
    assert {x.label for x in raw} >= {"local/route", "remote/pool", "remote/recompute", "local/storage"}
    for a, b in zip(raw, calibrated, strict=True):
        assert b.ttft_s == pytest.approx(0.1 + 2.0 * a.ttft_s), a.label


def test_a_path_correction_scales_only_its_own_path_and_can_flip_the_choice() -> None:
    engines = (EngineLoad("pe0", "prefill", 0), EngineLoad("de0", "decode", 0, num_decoding=1))
    req = AutoRequest("s", 8050, output_tokens=8, resident_tokens={"de0": 8000})
    snap = AutoSnapshot(engines)
    before = plan(req, snap, P)
    assert before is not None and before.chosen.label == "local/hbm"
    corrected = replace(P, path_scale={"local/hbm": 5.0})  # measured 5x its price: remote is cheaper
    raw, scaled = enumerate_plans(req, snap, P), enumerate_plans(req, snap, corrected)
    for a, b in zip(raw, scaled, strict=True):
        assert b.ttft_s == pytest.approx(a.ttft_s * (5.0 if a.label == "local/hbm" else 1.0)), a.label
    after = plan(req, snap, corrected)
    assert after is not None and after.chosen.label == "remote/hbm"


def test_a_local_prefill_is_priced_in_chunks_next_to_the_running_decodes() -> None:
    """TTFT: each chunk's T_pre plus one step of the 4 running decodes (9 ms); harm: each decode waits the
    chunks' T_pre; the live default budget (2048) takes two steps, so an earlier first token."""
    req = AutoRequest("r", 2500, output_tokens=1)
    snap = AutoSnapshot((colo("e0", num_decoding=4, max_num_batched_tokens=1000),))
    (local,) = enumerate_plans(req, snap, P)
    stall = 0.115 + 0.125 + 0.07125
    assert local.ttft_s == pytest.approx(stall + 3 * 0.009)
    assert local.harm_s == pytest.approx(4 * stall + terms.join_harm_s(P, 4, 0, 2500, 1, "colocated"))
    (coarse,) = enumerate_plans(req, AutoSnapshot((colo("e0", num_decoding=4),)), P)
    two_chunks = COSTS.prefill_s(0, 2048, "colocated") + COSTS.prefill_s(2048, 452, "colocated")
    assert coarse.ttft_s == pytest.approx(two_chunks + 2 * 0.009)
    assert coarse.ttft_s < local.ttft_s

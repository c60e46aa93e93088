"""AMPD's Algorithm 1 and session binding on hand-made windows and queues: every branch, ties, empty windows,
the history source of a remote prefill, and the baselines' routes."""

from __future__ import annotations

import pytest

from services.policy.ampd import (
    LOCAL,
    MODE_AMPD,
    MODE_LOCAL,
    MODE_REMOTE_LQ,
    MODE_REMOTE_RR,
    SOURCE_HBM,
    SOURCE_NONE,
    SOURCE_STORAGE,
    AmpdParams,
    DecodeOccupancy,
    DecodeView,
    PrefillView,
    TurnPrefill,
    bind_session,
    local_estimate,
    remote_estimate,
    route_by_mode,
    route_prefill,
)
from services.policy.ampd_costs import STORAGE, CostModel, Piecewise, linear_cost_model
from shared.errors import ConfigError

# 1,000 prefill tokens/s on every engine; the data plane moves 1,000 tokens' KV per second, storage 100
COSTS = linear_cost_model(
    prefill_tokens_per_s=1000.0,
    decode_step_s=0.01,
    kv_bytes_per_token=1000,
    link_bytes_per_s={"shm": 1e6, STORAGE: 1e5},
    link_alpha_s=0.0,
)
SLO = {"ttft_slo_s": 1.0, "itl_slo_s": 0.1}


def turn(hist: int = 1000, incr: int = 100, resident: int | None = None, stored: int = 0) -> TurnPrefill:
    return TurnPrefill(hist, incr, hist if resident is None else resident, stored, **SLO)


def test_a_prefill_engine_with_ttft_slack_takes_it_first_in_the_given_order() -> None:
    pes = [PrefillView("p2", ttft_s=0.95), PrefillView("p1", ttft_s=0.5), PrefillView("p0", ttft_s=0.1)]
    de = DecodeView("d", itl_s=0.0)  # even an idle DE loses to a PE with slack: line 1 comes first
    decision = route_prefill(turn(), de, pes, COSTS)
    assert (decision.target, decision.reason) == ("p1", "ttft_slack")  # p2 is above 0.9 x 1 s
    assert decision.history_source == SOURCE_HBM
    # the boundary counts as slack (<=), and an empty window reads 0
    assert route_prefill(turn(), de, [PrefillView("p9", ttft_s=0.9)], COSTS).target == "p9"


def test_the_least_queue_option_takes_the_slack_engine_with_the_least_queued_work() -> None:
    pes = [PrefillView("p1", 0.1, ((0, 500),)), PrefillView("p0", 0.2, ((0, 300),)), PrefillView("p2", 0.95)]
    params = AmpdParams(slack_order="least-queue")
    assert route_prefill(turn(), DecodeView("d", 0.0), pes, COSTS, params).target == "p0"  # p2: no slack
    with pytest.raises(ConfigError):
        AmpdParams(slack_order="fastest")


def test_local_when_every_prefill_engine_is_congested_and_the_decode_engine_has_itl_slack() -> None:
    pes = [PrefillView("p0", ttft_s=2.0), PrefillView("p1", ttft_s=0.91)]
    for itl in (0.0, 0.085):  # empty window; exactly beta x SLO
        decision = route_prefill(turn(), DecodeView("d", itl_s=itl), pes, COSTS)
        assert (decision.target, decision.reason) == (LOCAL, "itl_slack")
    congested = route_prefill(turn(), DecodeView("d", itl_s=0.086), pes, COSTS)
    assert congested.reason == "cost"


def test_both_congested_the_cheapest_estimate_wins() -> None:
    de_busy = DecodeView("d", itl_s=1.0, queue=((0, 5000),))  # 5 s of local prefill queued
    pes = [PrefillView("p0", ttft_s=9.0, queue=((0, 800),)), PrefillView("p1", ttft_s=9.0, queue=((0, 200),))]
    decision = route_prefill(turn(), de_busy, pes, COSTS)
    # Eq. 2 on p1: 1 s history in + 0.1 s compute + 0.1 s increment back + 0.2 s queue
    assert (decision.target, decision.reason) == ("p1", "cost")
    assert decision.estimate_s == pytest.approx(1.0 + 0.1 + 0.1 + 0.2)
    de_idle_queue = DecodeView("d", itl_s=1.0)
    local = route_prefill(turn(), de_idle_queue, pes, COSTS)  # Eq. 1: 0.1 s, no transfers
    assert (local.target, local.reason, local.estimate_s) == (LOCAL, "cost", pytest.approx(0.1))


def test_ties_go_to_local_then_to_the_lowest_prefill_engine_id() -> None:
    free = linear_cost_model(
        prefill_tokens_per_s=1000.0, decode_step_s=0.01, kv_bytes_per_token=1,
        link_bytes_per_s={"shm": 1e18, STORAGE: 1e18}, link_alpha_s=0.0,
    )  # fmt: skip
    congested = DecodeView("d", itl_s=1.0)
    pes = [PrefillView("p1", ttft_s=9.0), PrefillView("p0", ttft_s=9.0)]
    assert route_prefill(turn(), congested, pes, free).target == LOCAL  # equal estimates
    busy_de = DecodeView("d", itl_s=1.0, queue=((0, 10),))
    assert route_prefill(turn(), busy_de, pes, free).target == "p0"


def test_without_prefill_engines_every_prefill_is_local() -> None:
    decision = route_prefill(turn(), DecodeView("d", itl_s=5.0), [], COSTS)
    assert (decision.target, decision.reason) == (LOCAL, "only_local")


def test_initial_prefills_may_be_forced_remote() -> None:
    pes = [PrefillView("p0", ttft_s=9.0, queue=((0, 900),)), PrefillView("p1", ttft_s=9.0)]
    initial = turn(hist=0, incr=500)
    forced = route_prefill(initial, DecodeView("d", itl_s=0.0), pes, COSTS, AmpdParams(route_initial=False))
    assert (forced.target, forced.reason, forced.history_source) == ("p1", "only_remote", SOURCE_NONE)
    adaptive = route_prefill(initial, DecodeView("d", itl_s=0.0), pes, COSTS)
    assert adaptive.target == LOCAL


def test_the_remote_history_comes_from_the_cheaper_source() -> None:
    pe = PrefillView("p", ttft_s=0.0)
    # resident on the DE: 1 s over the data plane; stored: 10 s from storage
    assert remote_estimate(turn(stored=1000), pe, COSTS, "shm")[1] == SOURCE_HBM
    # evicted from the DE, still stored: read it (10 s) rather than recompute (1,100 tokens over 1,000
    # tokens of history: 1.1 s) - here recomputing is cheaper, so nothing is read
    evicted = turn(resident=0, stored=1000)
    assert remote_estimate(evicted, pe, COSTS, "shm")[1] == SOURCE_NONE
    fast_storage = linear_cost_model(
        prefill_tokens_per_s=1000.0, decode_step_s=0.01, kv_bytes_per_token=1000,
        link_bytes_per_s={"shm": 1e6, STORAGE: 1e8}, link_alpha_s=0.0,
    )  # fmt: skip
    seconds, source = remote_estimate(evicted, pe, fast_storage, "shm")
    assert source == SOURCE_STORAGE
    assert seconds == pytest.approx(0.01 + 0.1 + 1.1)  # read, compute the increment, send all of it back


def test_local_estimate_loads_an_evicted_history_from_storage() -> None:
    de = DecodeView("d", itl_s=0.0, queue=((10, 300),))
    resident = local_estimate(turn(), de, COSTS)
    assert resident == pytest.approx(0.1 + 0.3)
    evicted = local_estimate(turn(resident=0, stored=1000), de, COSTS)
    assert evicted == pytest.approx(10.0 + 0.1 + 0.3)


def test_the_attention_term_makes_long_histories_cost_more() -> None:
    costs = CostModel(
        kv_bytes_per_token=1,
        prefill={"prefill": Piecewise((0.0, 512.0), ((0.01, 1e-3, 1e-6), (0.02, 5e-4, 1e-6)))},
        decode={"decode": Piecewise((0.0,), ((0.01, 0.0, 0.0),))},
        links={"shm": COSTS.links["shm"]},
    )
    short, long = costs.prefill_s(0, 100), costs.prefill_s(10_000, 100)
    assert short == pytest.approx(0.01 + 0.1 + 1e-6 * 100 * 50)
    assert long > short + 0.9  # 100 x 10,000 x 1e-6 s of attention to the history
    assert costs.prefill_s(0, 1000) == pytest.approx(0.02 + 0.5 + 1e-6 * 1000 * 500)  # second segment
    assert costs.prefill_s(5, 0) == 0.0 and costs.kv_s(0, "shm") == 0.0  # T_kv(0) = 0
    assert CostModel.from_dict(costs.to_dict()) == costs


def test_binding_takes_the_lowest_occupancy_then_the_smallest_batch_then_the_id() -> None:
    engines = [
        DecodeOccupancy("d2", used_kv_tokens=100, total_kv_tokens=1000, num_running=3),
        DecodeOccupancy("d1", used_kv_tokens=100, total_kv_tokens=1000, num_running=1),
        DecodeOccupancy("d0", used_kv_tokens=300, total_kv_tokens=4000, num_running=9),  # 7.5%
        DecodeOccupancy("d3", used_kv_tokens=0, total_kv_tokens=1000, num_running=0, is_draining=True),
    ]
    assert bind_session(engines) == "d0"
    assert bind_session(engines[:2]) == "d1"
    tie = [DecodeOccupancy(i, 0, 100, 0) for i in ("db", "da")]
    assert bind_session(tie) == "da"
    assert bind_session([engines[3]]) is None


def test_a_session_unknown_to_the_router_goes_back_where_its_kv_is_resident() -> None:
    """A restarted router (or another replica) holds no binding for the session: the DE the index lists
    most of its prompt on takes it, though another is emptier; not a draining one; with none holding any of
    it, the lowest occupancy decides as for a new session."""
    engines = [
        DecodeOccupancy("d0", used_kv_tokens=100, total_kv_tokens=1000, num_running=0),
        DecodeOccupancy("d1", used_kv_tokens=900, total_kv_tokens=1000, num_running=4),
        DecodeOccupancy("d2", used_kv_tokens=600, total_kv_tokens=1000, num_running=4),
    ]
    assert bind_session(engines, {"d1": 640, "d2": 500}) == "d1"
    assert bind_session(engines, {"d1": 320, "d2": 320}) == "d2"  # a tie: the lower occupancy
    assert bind_session(engines, {"d1": 0, "d2": 0}) == "d0"
    draining = [engines[0], DecodeOccupancy("d1", 700, 1000, 4, is_draining=True)]
    assert bind_session(draining, {"d1": 640}) == "d0"


def test_the_baselines_route_every_prefill_the_same_way() -> None:
    pes = [PrefillView("p1", ttft_s=9.0), PrefillView("p0", ttft_s=9.0, queue=((0, 100),))]
    de, params = DecodeView("d", itl_s=0.0), AmpdParams()
    targets, cursor = [], 0
    for _ in range(3):
        decision, cursor = route_by_mode(MODE_REMOTE_RR, turn(), de, pes, COSTS, params, cursor)
        assert decision is not None
        targets.append(decision.target)
    assert targets == ["p0", "p1", "p0"]
    least, _ = route_by_mode(MODE_REMOTE_LQ, turn(), de, pes, COSTS, params)
    assert least is not None and least.target == "p1"
    local, _ = route_by_mode(MODE_LOCAL, turn(), de, pes, COSTS, params)
    assert local is not None and local.is_local
    assert route_by_mode(MODE_REMOTE_RR, turn(), de, [], COSTS, params) == (None, 0)
    ampd, _ = route_by_mode(MODE_AMPD, turn(), de, pes, COSTS, params)
    assert ampd is not None and ampd.reason == "itl_slack"
    with pytest.raises(ConfigError):
        route_by_mode("fastest", turn(), de, pes, COSTS, params)


def test_inconsistent_inputs_are_refused() -> None:
    with pytest.raises(ConfigError):
        TurnPrefill(100, 10, 200, 0, **SLO)  # more resident than history
    with pytest.raises(ConfigError):
        CostModel.from_dict({"schema": "something else"})
    with pytest.raises(ConfigError):
        Piecewise((10.0, 0.0), ((1.0,), (2.0,)))

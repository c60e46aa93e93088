"""The `auto` estimator's terms against hand-computed numbers (services/policy/auto_costs.py)."""

from __future__ import annotations

import pytest

from services.policy import auto_costs as terms
from services.policy.ampd_costs import CostModel, Link, Piecewise
from services.policy.auto_costs import AutoProfiles
from services.policy.movequery import Compute, CostProfile, Fabric, ModelShape
from shared.errors import ConfigError

# T_pre = 10 ms + 0.1 ms per new token (+ 1e-8 s per new x cached token); T_dec = 5 ms + 1 ms per sequence
# + 1 us per context token; 1000 bytes of KV per token
PRE = Piecewise((0.0,), ((0.01, 1e-4, 1e-8),))
DEC = Piecewise((0.0,), ((0.005, 1e-3, 1e-6),))
LINKS = {"storage": Link(1e-3, 1e6), "pool": Link(0.0, 1e8), "shm": Link(5e-4, 1e8)}
COSTS = CostModel(1000, {"prefill": PRE, "decode": PRE}, {"prefill": DEC, "decode": DEC}, LINKS)
ROUTE = CostProfile(
    shape=ModelShape(2, 1, 100, 100, 1000),
    compute=Compute(local_s_per_token_layer=1e-4),
    fabrics={"shm": Fabric("shm", 1e-3, 1e6)},
)


def profiles(**kw: object) -> AutoProfiles:
    return AutoProfiles(costs=COSTS, route=ROUTE, **kw)  # type: ignore[arg-type]


def test_prefill_queue_prices_queued_tokens_as_one_batch_without_the_attention_term() -> None:
    assert terms.prefill_queue_s(profiles(), 1000, "prefill") == pytest.approx(0.01 + 0.1)
    assert terms.prefill_queue_s(profiles(), 1000, "unknown-kind") == pytest.approx(0.01 + 0.1)
    assert terms.prefill_queue_s(profiles(), 0, "prefill") == 0.0


def test_read_waits_for_the_queue_then_moves_its_own_bytes() -> None:
    # 500 queued + 500 own tokens = 1 MB at 1 MB/s, plus the 1 ms fixed cost
    assert terms.read_s(profiles(), "storage", 500, 500) == pytest.approx(1.001)
    assert terms.read_s(profiles(), "storage", 500, 0) == 0.0
    assert terms.read_s(profiles(), "pool", 0, 1000) == pytest.approx(0.01)


def test_link_adds_its_busy_time() -> None:
    assert terms.link_s(profiles(), 1000, busy_s=0.2) == pytest.approx(0.2 + 5e-4 + 0.01)
    assert terms.link_s(profiles(), 0, busy_s=0.2) == 0.0


def test_compute_depends_on_hit_and_miss_and_a_full_hit_computes_one_token() -> None:
    assert terms.compute_s(profiles(), 0, 1000, "prefill") == pytest.approx(0.01 + 0.1 + 1e-8 * 1000 * 500)
    assert terms.compute_s(profiles(), 1000, 1000, "prefill") == pytest.approx(
        0.01 + 0.1 + 1e-8 * 1000 * 1500
    )
    assert terms.compute_s(profiles(), 1000, 0, "prefill") == pytest.approx(0.01 + 1e-4 + 1e-8 * 1000.5)


def test_stall_harm_pauses_every_running_decode() -> None:
    assert terms.stall_harm_s(profiles(), 0.5, 4) == pytest.approx(0.5 * 4)
    assert terms.stall_harm_s(profiles(itl_weight=0.1), 0.5, 4) == pytest.approx(0.1 * 0.5 * 4)
    assert terms.stall_harm_s(profiles(itl_weight=1.0), 0.5, 0) == 0.0


def test_join_harm_is_the_slower_step_for_every_running_decode_and_output_token() -> None:
    # before: 5 + 4 + 4 ms; after (5 sequences, 5000 tokens): 5 + 5 + 5 ms: 2 ms x 4 decodes x 10 steps
    assert terms.join_harm_s(profiles(), 4, 4000, 1000, 10, "decode") == pytest.approx(0.08)
    assert terms.join_harm_s(profiles(), 0, 0, 1000, 10, "decode") == 0.0


def test_route_costs_per_layer_exchange_before_and_after_the_first_token() -> None:
    # 10 new tokens x 1 row: 1 ms probe + 10 x 200 B / 1 MB/s, two layers; later steps 1 row each
    first, later = terms.route_costs_s(profiles(), 4000, 10, 5, 0.0) or (0.0, 0.0)
    assert first == pytest.approx(2 * 3e-3)
    assert later == pytest.approx(4 * 2 * 1.2e-3)
    queued = terms.route_costs_s(profiles(), 4000, 10, 5, 0.01)
    assert queued is not None and queued[0] == pytest.approx(2 * (3e-3 + 0.01))
    assert terms.route_costs_s(AutoProfiles(costs=COSTS), 4000, 10, 5, 0.0) is None


def test_negative_itl_weight_is_refused() -> None:
    with pytest.raises(ConfigError):
        AutoProfiles(costs=COSTS, itl_weight=-1.0)


def test_a_long_prefill_runs_in_chunks_of_the_budget_each_step_with_the_decode_batch() -> None:
    # 2500 new tokens in chunks of 1000 over 0, 1000 and 2000 cached ones: 115 + 125 + 71.25 ms of T_pre, and
    # three 20 ms decode steps before the first token
    pre = terms.chunked_prefill(profiles(), 0, 2500, "prefill", budget_tokens=1000, decode_step_s=0.02)
    assert pre.num_steps == 3
    assert pre.stall_s == pytest.approx(0.115 + 0.125 + 0.07125)
    assert pre.ttft_s == pytest.approx(0.115 + 0.125 + 0.07125 + 3 * 0.02)
    # the hit is loaded with the first chunk and costs no budget; only the new tokens are chunked
    hit = terms.chunked_prefill(profiles(), 5000, 2000, "prefill", budget_tokens=1000)
    assert hit.num_steps == 2
    assert hit.stall_s == pytest.approx(2 * (0.01 + 0.1) + 1e-8 * 1000 * (5500 + 6500))
    # within one budget it is the unchunked prefill, a full hit computing its last token
    one = terms.chunked_prefill(profiles(), 1000, 1000, "prefill", budget_tokens=2048)
    assert (one.num_steps, one.stall_s) == (
        1,
        pytest.approx(terms.compute_s(profiles(), 1000, 1000, "prefill")),
    )
    full = terms.chunked_prefill(profiles(), 1000, 0, "prefill")
    assert (full.num_steps, full.stall_s) == (
        1,
        pytest.approx(terms.compute_s(profiles(), 1000, 0, "prefill")),
    )


def test_a_queue_fills_the_budget_step_by_step_next_to_the_decodes() -> None:
    # 2500 queued tokens: 3 steps, each T_pre's fixed 10 ms and a 20 ms decode step, plus 0.1 ms a token
    queued = terms.prefill_queue_s(profiles(), 2500, "prefill", budget_tokens=1000, decode_step_s=0.02)
    assert queued == pytest.approx(3 * (0.01 + 0.02) + 0.25)
    assert terms.prefill_queue_s(profiles(), 2500, "prefill", budget_tokens=4096) == pytest.approx(
        0.01 + 0.25
    )


def test_the_default_budget_is_the_engine_default() -> None:
    from dataclasses import fields

    from services.engine.config import EngineConfig

    default = next(f.default for f in fields(EngineConfig) if f.name == "max_num_batched_tokens")
    assert terms.DEFAULT_MAX_NUM_BATCHED_TOKENS == default

"""The router's `--policy auto` choice over a real engine table: an engine holding the prefix in its own tiers
wins while it is free; the router's own ledger of predicted first tokens makes a busy one lose; a decision is
counted, spanned and closed with its measured TTFT."""

from __future__ import annotations

import time

import pytest

from services.router import metrics
from services.router.auto_dispatch import AutoDispatch, build_auto_dispatch
from services.router.config import RouterConfig
from services.router.engines import EngineTable
from shared.protocol import KvFormat, LoadReport, TokenBatch
from shared.protocol.messages import SamplingParams, TokenDelta
from shared.protocol.tasks import KvPlan, RequestPlan

FMT = KvFormat(fingerprint="tiny;dtype=float32;block_size=64", block_size=64, bytes_per_token=4096)


def dispatch() -> AutoDispatch:
    engines = EngineTable(silence_timeout_s=3.0)
    now = time.monotonic()
    for i, engine_id in enumerate(("e0", "e1", "storage-0")):
        role = "storage" if engine_id.startswith("storage") else "colocated"
        rates = (
            {"prefill_tokens_per_s": 2000.0} if role == "colocated" else {"read_bandwidth_bytes_per_s": 1e8}
        )
        report = LoadReport(
            service_id=engine_id,
            role=role,
            node=0,
            seq=1,
            sent_at=0.0,
            free_kv_blocks=1000,
            kv_format=FMT,
            rates=rates,
            num_running=i % 2,
        )
        engines.update(report, now=now)
    return AutoDispatch(engines, bus=None, router_id="x", ack_timeout_s=1.0)  # type: ignore[arg-type]


def plan(request_id: str) -> RequestPlan:
    return RequestPlan(
        request_id=request_id,
        router_id="x",
        prompt_token_ids=[5] * (64 * 32 + 10),
        sampling=SamplingParams(max_tokens=8),
        deadline_unix_s=5.0,
        kv=KvPlan(block_hashes=list(range(32)), num_hit_blocks=32),
    )


def test_the_engine_holding_the_prefix_wins_until_the_ledger_says_it_is_busy() -> None:
    d = dispatch()
    snapshots = list(d.engines.engine_snapshots(64, ("colocated",)))
    locality = {"store": 32, "dram:e1": 32}
    assert d._pick(snapshots, plan("a"), locality) == "e1"
    assert d._picked["a"].chosen.label == "local/hbm"
    assert d._picked["a"].runner_up is not None and d._picked["a"].runner_up.label == "local/storage"
    d.ledger.add("e1", "earlier", time.monotonic() + 30.0)  # e1 has 30 s of predicted work queued
    assert d._pick(snapshots, plan("b"), locality) == "e0"
    assert d._picked["b"].chosen.label == "local/storage"


def test_a_decision_is_counted_closed_by_its_first_token_and_its_residual_learned() -> None:
    d = dispatch()
    snapshots = list(d.engines.engine_snapshots(64, ("colocated",)))
    before = metrics.PLANS.labels("local/storage")._value.get()
    errors = metrics.PLAN_TTFT_ERROR._sum.get()
    assert d._pick(snapshots, plan("c"), {"store": 32}) == "e0"
    predicted = d._picked["c"].chosen.ttft_s
    started = time.monotonic()
    d._opened("c", d._picked.pop("c"), started)
    assert metrics.PLANS.labels("local/storage")._value.get() == before + 1
    assert d.ledger.busy_s("e0", started) == pytest.approx(predicted)
    first = TokenDelta(request_id="c", seq=0, token_ids=[1])
    d.on_token_batch(TokenBatch(engine_id="e0", step=1, deltas=[first]), started + predicted + 0.2)
    assert "c" not in d._open and d.ledger.busy_s("e0", started) == 0.0
    assert d.ledger.num_decoding("e0") == 1  # decoding until the request leaves the router
    assert metrics.PLAN_TTFT_ERROR._sum.get() == pytest.approx(errors + 0.2)
    # the 0.2 s the model left out is learned (the first residual in full) and goes into the next prediction
    assert d.calibration.overhead_s == pytest.approx(0.2)
    d.release("c")
    assert d.ledger.num_decoding("e0") == 0
    assert d._pick(snapshots, plan("e"), {"store": 32}) == "e0"
    assert d._picked["e"].chosen.ttft_s == pytest.approx(predicted + 0.2)


def test_auto_is_a_router_policy_and_keeps_move_the_query() -> None:
    config = RouterConfig(policy="auto", move_query="fetch")
    config.validate()
    built = build_auto_dispatch(config, EngineTable(silence_timeout_s=3.0), None, "x")  # type: ignore[arg-type]
    assert isinstance(built, AutoDispatch) and built.held_routing is not None
    assert build_auto_dispatch(RouterConfig(policy="auto"), built.engines, None, "x").held_routing is None  # type: ignore[arg-type]

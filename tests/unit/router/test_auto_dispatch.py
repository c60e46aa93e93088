"""The router's `--policy auto` choice over a real engine table: an engine holding the prefix in its own tiers
wins while it is free; the router's own ledger of predicted first tokens makes a busy one lose; a decision is
counted, spanned and closed with its measured TTFT."""

from __future__ import annotations

import time

import pytest

from services.policy.auto import Source, enumerate_plans
from services.policy.auto_costs import DEFAULT_MAX_NUM_BATCHED_TOKENS
from services.policy.thresholds import FALLBACK_PREFILL_TOKENS_PER_S
from services.router import metrics
from services.router.auto_dispatch import AutoDispatch, build_auto_dispatch
from services.router.auto_pd import remote_history
from services.router.config import RouterConfig
from services.router.engines import EngineTable
from shared.protocol import COMPUTE_RATE, PROMPT_RATE, KvFormat, LoadReport, RouteCapability, TokenBatch
from shared.protocol.messages import SamplingParams, TokenDelta
from shared.protocol.tasks import KvPlan, RequestPlan

FMT = KvFormat(fingerprint="tiny;dtype=float32;block_size=64", block_size=64, bytes_per_token=4096)


COLOCATED = (("e0", "colocated", 0), ("e1", "colocated", 0), ("storage-0", "storage", 0))
PD = (("pe", "prefill", 0), ("de", "decode", 1), ("s0", "storage", 0), ("s1", "storage", 1))


def dispatch(
    services: tuple[tuple[str, str, int], ...] = COLOCATED,
    decode_engines: str = "session",
    engine_rates: dict[str, float] | None = None,
) -> AutoDispatch:
    engines = EngineTable(silence_timeout_s=3.0)
    now = time.monotonic()
    for i, (engine_id, role, node) in enumerate(services):
        rates = {"read_bandwidth_bytes_per_s": 1e8}
        if role != "storage":
            rates = engine_rates or {PROMPT_RATE: 2000.0, COMPUTE_RATE: 2000.0}
        report = LoadReport(
            service_id=engine_id,
            role=role,
            node=node,
            seq=1,
            sent_at=0.0,
            free_kv_blocks=1000,
            kv_format=FMT,
            rates=rates,
            num_running=i % 2,
        )
        engines.update(report, now=now)
    return AutoDispatch(engines, None, "x", 1.0, decode_engines=decode_engines)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("topology", ["colocated", "pd"])
def test_without_a_profile_new_tokens_are_priced_at_the_compute_rate_not_the_prompt_rate(
    topology: str,
) -> None:
    """An agent's engines load 95% of every prompt: their prompt rate (loaded + computed tokens a second)
    is 40x their compute rate. Priced at the prompt rate, recomputing a 2,058-token context took 26 ms
    against 84 ms to read it from storage, so auto recomputed it (and measured ~400 ms on this host);
    priced at the compute rate it reads it."""
    services = COLOCATED if topology == "colocated" else PD
    d = dispatch(services, engine_rates={PROMPT_RATE: 80_000.0, COMPUTE_RATE: 2_000.0})
    assert d.profiles().costs.prefill_s(0, 2000) == pytest.approx(1.0)  # 2,000 tokens at 2,000 a second
    roles = ("colocated",) if topology == "colocated" else ("prefill", "decode")
    snapshots = list(d.engines.engine_snapshots(64, roles))
    assert d._pick(snapshots, plan("long"), {"store": 32}) is not None
    chosen = d._picked["long"].chosen
    assert chosen.label.endswith("/storage") and chosen.ttft_s < 0.5, chosen
    unmeasured = dispatch(services, engine_rates={PROMPT_RATE: 80_000.0})  # no step computed alone yet
    fallback = 2000 / FALLBACK_PREFILL_TOKENS_PER_S
    assert unmeasured.profiles().costs.prefill_s(0, 2000) == pytest.approx(fallback)


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


@pytest.mark.parametrize(
    ("decode_engines", "offered", "never"),
    [
        ("session", {"local/hbm", "remote/hbm", "local/storage", "remote/storage"}, {"remote/storage-de"}),
        ("dualpath", {"remote/storage", "remote/storage-de"}, {"local/storage", "local/hbm", "remote/hbm"}),
    ],
)
def test_on_prefill_decode_engines_only_the_paths_of_the_decode_engines_are_planned(
    decode_engines: str, offered: set[str], never: set[str]
) -> None:
    d = dispatch(PD, decode_engines)
    snapshots = list(d.engines.engine_snapshots(64, ("prefill", "decode")))
    request = d._request(snapshots, plan("p"), {"store": 32, "hbm:de": 32})
    snapshot = d._snapshot(snapshots, {"store": 32, "hbm:de": 32})
    labels = {p.label for p in enumerate_plans(request, snapshot, d.profiles())}
    assert offered <= labels and not never & labels, labels
    assert snapshot.local_on_decode == (decode_engines == "session")


def test_the_history_of_a_remote_plan_is_what_the_decode_engine_kept_or_storage() -> None:
    hashes = KvPlan(block_hashes=list(range(8)))
    kept = remote_history(hashes, Source.HBM, 6, 7, kept_blocks=8)
    assert (kept.num_hit_blocks, kept.read_side) == (7, "hbm")  # never more than a prefill may skip
    gone = remote_history(hashes, Source.HBM, 6, 7, kept_blocks=0)  # planned hbm, the session's KV is gone
    assert (gone.num_hit_blocks, gone.read_side) == (6, "pe")
    stored = remote_history(hashes, Source.STORAGE, 6, 7, kept_blocks=5)
    assert (stored.num_hit_blocks, stored.read_side) == (6, "pe")
    assert remote_history(hashes, Source.RECOMPUTE, 6, 7, kept_blocks=5).num_hit_blocks == 0


def test_with_move_query_auto_a_held_chunk_is_resident_on_its_holder_and_routed_to_elsewhere() -> None:
    d = build_auto_dispatch(RouterConfig(policy="auto", move_query="auto"), dispatch().engines, None, "x")  # type: ignore[arg-type]
    shape = RouteCapability(
        num_layers=4,
        rows_per_token=8,
        query_bytes_per_row=128,
        partial_bytes_per_row=136,
        kv_bytes_per_token_layer=512,
    )
    for engine_id in ("e0", "e1"):
        state = d.engines.get(engine_id)
        assert state is not None
        state.report.route = shape
    snapshots = list(d.engines.engine_snapshots(64, ("colocated",)))
    locality = {"store": 32, "held:e1": 32}
    request = d._request(snapshots, plan("h"), locality)
    assert request.held_tokens == {"e1": 64 * 32} and request.resident_tokens["e1"] == 64 * 32
    plans = enumerate_plans(request, d._snapshot(snapshots, locality), d.profiles())
    assert {(x.label, x.decode_engine) for x in plans} >= {("local/hbm", "e1"), ("local/route", "e0")}
    assert d._pick(snapshots, plan("h"), locality) == "e1"  # free: its own copy of the chunk is cheapest
    d.ledger.add("e1", "earlier", time.monotonic() + 30.0)  # the holder is busy for 30 s
    assert d._pick(snapshots, plan("i"), locality) == "e0"
    chosen = d._picked["i"].chosen
    want = {"local/route": "route", "local/recompute": "local"}.get(chosen.label, "fetch")
    assert d.held_primitive(plan("i")) == want  # what the held prefix's plan will say
    for primitive in ("route", "fetch", "local"):  # and route_choice writes it, not its own pick
        p = plan(f"i-{primitive}")
        d.held_routing.apply(p, "e0", locality, primitive)
        assert p.kv.held is not None and p.kv.held.primitive == primitive
    forced = build_auto_dispatch(RouterConfig(policy="auto", move_query="route"), d.engines, None, "x")  # type: ignore[arg-type]
    assert (
        forced._request(snapshots, plan("j"), locality).held_tokens == {}
    )  # a forced mode decides after auto
    assert Source.ROUTE not in forced._snapshot(snapshots, locality).sources


def test_each_engine_is_priced_with_the_prefill_budget_its_load_report_states() -> None:
    auto = dispatch()
    state = auto.engines.get("e0")
    assert state is not None
    state.report.max_num_batched_tokens = 512
    snap = auto._snapshot(auto.engines.engine_snapshots(64, ("colocated",)), {})
    budgets = {e.engine_id: e.max_num_batched_tokens for e in snap.engines}
    assert budgets == {"e0": 512, "e1": DEFAULT_MAX_NUM_BATCHED_TOKENS}  # e1 says nothing: the default


async def test_a_burst_decided_before_any_is_sent_spreads_and_a_failed_send_drops_its_reservation() -> None:
    """Requests decided while earlier ones still wait for their engine's ack see those plans in the ledger
    (else a burst all lands on the engine that looked cheapest to its first request)."""
    d = dispatch()
    snapshots = list(d.engines.engine_snapshots(64, ("colocated",)))
    locality = {"store": 32, "dram:e1": 32}  # e1 holds the prefix, e0 reads it from storage
    picks = [d._pick(snapshots, plan(f"b{i}"), locality) for i in range(40)]
    assert picks[0] == "e1" and "e0" in picks, picks
    first, second = d._picked["b0"].chosen, d._picked["b1"].chosen
    assert second.decode_engine == "e1" and second.ttft_s == pytest.approx(2 * first.ttft_s, abs=1e-3)
    # a decision taken again for the same request (a retry) replaces its reservation
    busy = d.ledger.busy_s("e1", time.monotonic())
    d._pick(snapshots, plan("b0"), locality)
    assert d.ledger.busy_s("e1", time.monotonic()) <= busy
    # a dispatch that fails after deciding (injected: this table has no bus to send on) leaves no reservation
    fresh = dispatch()
    with pytest.raises(AttributeError):
        await fresh.dispatch(plan("f"), time.monotonic() + 5, None, locality)  # type: ignore[arg-type]
    assert fresh.ledger.busy_s("e1", time.monotonic()) == 0.0 and not fresh._reserved

"""Move the query at the router: a request whose prompt starts with a chunk another live engine holds gets a
`HeldPrefix` priced by the cost model (auto) or forced (route / fetch / local); nothing held elsewhere, a
dead or draining holder, or a requester that does not speak the protocol leaves the plan alone. A request
naming a chunk (`kv_chunk`) is steered to the engine that should keep it."""

from __future__ import annotations

import dataclasses
import time

import pytest

from services.router.engines import EngineTable
from services.router.route_choice import HeldRouting, measured_delay_s
from shared.errors import NoEngineAvailableError
from shared.protocol import KvFormat, LoadReport, RouteCapability
from shared.protocol.messages import SamplingParams
from shared.protocol.movequery import ChunkName
from shared.protocol.tasks import KvPlan, RequestPlan

FMT = KvFormat(fingerprint="tiny;dtype=float32;block_size=64", block_size=64, bytes_per_token=4096)
ROUTE = RouteCapability(  # the tiny model's shape (services/engine/route_shape.py)
    num_layers=4,
    rows_per_token=8,
    query_bytes_per_row=128,
    partial_bytes_per_row=136,
    kv_bytes_per_token_layer=512,
)


def table(
    *,
    holder_speaks: bool = True,
    draining: bool = False,
    free_kv_blocks: int = 1000,
    waiting: dict[str, int] | None = None,
    holds: tuple[str, ...] = (),
    compute: dict[str, str] | None = None,
    holder_queue_s: float = 0.0,
    release: dict[str, tuple[list[float], list[int]]] | None = None,
    decode_step_s: float = 0.0,
) -> EngineTable:
    """e0 and e1; those in `holds` may hold chunks; `compute`: their `compute_id`s (none by default);
    `holder_queue_s`: e0's; `release`: engines' release schedules (reports sent now); every cache holds
    `free_kv_blocks` in all, free, and decodes a step in `decode_step_s`."""
    engines = EngineTable(silence_timeout_s=3.0)
    now = time.monotonic()
    for engine_id in ("e0", "e1"):
        route = dataclasses.replace(ROUTE, hold_budget_blocks=100 if engine_id in holds else 0)
        if engine_id == "e0":
            route = dataclasses.replace(route, holder_queue_s=holder_queue_s)
        release_s, release_tokens = (release or {}).get(engine_id, ([], []))
        report = LoadReport(
            service_id=engine_id,
            role="colocated",
            node=0,
            seq=1,
            sent_at=time.time() if release_s else 0.0,
            kv_release_s=release_s,
            kv_release_tokens=release_tokens,
            free_kv_blocks=free_kv_blocks,
            total_kv_blocks=free_kv_blocks,
            decode_step_s=decode_step_s,
            kv_format=FMT,
            waiting_kv_tokens=(waiting or {}).get(engine_id, 0),
            route=route if holder_speaks or engine_id != "e0" else None,
            is_draining=draining and engine_id == "e0",
            compute_id=(compute or {}).get(engine_id, ""),
        )
        engines.update(report, now=now)
    return engines


def plan(prompt_tokens: int, max_tokens: int, hits: int = 0, request_id: str = "r") -> RequestPlan:
    return RequestPlan(
        request_id=request_id,
        router_id="x",
        prompt_token_ids=[5] * prompt_tokens,
        sampling=SamplingParams(max_tokens=max_tokens),
        deadline_unix_s=5.0,
        kv=KvPlan(block_hashes=list(range(prompt_tokens // 64)), num_hit_blocks=hits),
    )


@pytest.mark.parametrize("mode", ["route", "fetch", "local"])
def test_forced_primitives(mode: str) -> None:
    routing = HeldRouting(table(), mode=mode, profile=None, fabric="shm")
    p = plan(64 * 8 + 30, 16, hits=8)
    routing.apply(p, "e1", {"held:e0": 8, "store": 8})
    held = p.kv.held
    assert held is not None and (held.holder_id, held.num_blocks, held.primitive) == ("e0", 8, mode)
    assert held.fallback == "fetch" and held.take_s == 0.0  # forced: never repriced
    assert p.kv.num_hit_blocks == (0 if mode == "local" else 8)
    assert routing.avoid({"held:e0": 8}) == {"e0"}
    assert HeldRouting(table(), mode="auto", profile=None, fabric="shm").avoid({"held:e0": 8}) == set()


def test_auto_prices_the_request_and_the_chunk_size_limits_the_blocks() -> None:
    routing = HeldRouting(table(), mode="auto", profile=None, fabric="shm")
    p = plan(64 * 4 + 10, 4)
    routing.apply(p, "e1", {"held:e0": 9})  # the holder's chunk is longer than this prompt's usable blocks
    held = p.kv.held
    assert held is not None and held.num_blocks == 4 and held.fallback == "local"  # not in the store
    assert held.primitive in ("route", "local") and held.take_s > 0 and held.local_step_s > 0


def test_nothing_to_route() -> None:
    routing = HeldRouting(table(), mode="auto", profile=None, fabric="shm")
    for engine_id, locality in (("e0", {"held:e0": 8}), ("e1", {"store": 8}), ("e1", {"held:gone": 8})):
        p = plan(64 * 8 + 30, 16)
        routing.apply(p, engine_id, locality)  # the holder itself, nothing held, a holder that is not live
        assert p.kv.held is None
    for engines in (table(holder_speaks=False), table(draining=True)):  # speaks no route protocol; draining
        p = plan(64 * 8 + 30, 16)
        HeldRouting(engines, mode="route", profile=None, fabric="shm").apply(p, "e1", {"held:e0": 8})
        assert p.kv.held is None


def test_auto_routes_the_burst_the_requester_cannot_hold_copies_for() -> None:
    """Memory-bound fan-in: sub-agents of one 2048-token document (32 blocks) reach a requester with 96 free
    blocks at once. Each fetch keeps a copy of the document there (counted before the next report), so auto
    fetches while two more copies fit, then routes (suffix + answer only); queued work the engine reports
    counts as taken; a holder without room for the request is not picked in auto either. A request routed
    for want of room is never repriced into taking a copy between decode steps (take_s 0): the copy would
    be the memory the route saved."""
    routing = HeldRouting(table(free_kv_blocks=96), mode="auto", profile=None, fabric="shm")
    locality = {"held:e0": 32, "store": 32}
    choices = []
    for _ in range(6):
        p = plan(64 * 32 + 300, 32, hits=32)
        routing.apply(p, "e1", locality)
        assert p.kv.held is not None
        choices.append((p.kv.held.primitive, p.kv.held.take_s > 0))
    assert choices == [("fetch", True)] + [("route", False)] * 5
    assert routing.free_kv_tokens("e1") == 96 * 64 - (2048 + 332) - 5 * 332
    queued = table(free_kv_blocks=96, waiting={"e1": 3000})
    p = plan(64 * 32 + 300, 32, hits=32)
    HeldRouting(queued, mode="auto", profile=None, fabric="shm").apply(p, "e1", locality)
    assert p.kv.held is not None and p.kv.held.primitive == "route"
    assert routing.avoid(locality, plan(64 * 32 + 300, 32)) == set()  # the holder has room for it
    full = table(free_kv_blocks=96, waiting={"e0": 6000})
    full_holder = HeldRouting(full, mode="auto", profile=None, fabric="shm")
    assert full_holder.avoid(locality, plan(64 * 32 + 300, 32)) == {"e0"}


def test_auto_waits_for_the_requesters_memory_when_that_costs_less_than_a_busy_holder() -> None:
    """A requester with room for one copy of the document but not a second: with an idle holder the
    sub-agent routes; with a holder whose queue holds every exchange 50 ms (4 layers x 32 steps: ~6 s more),
    it fetches if the requester's load report says a running request gives 64 blocks back in 0.2 s (the wait
    is priced), and routes again if that release is 30 s away or unknown, or once the router's own
    dispatches exceed the free KV. The report's age counts: the same 0.2 s release in a report sent 0.15 s
    ago is 0.05 s away."""
    locality = {"held:e0": 32, "store": 32}

    def choice(holder_queue_s: float, release: tuple[list[float], list[int]] | None) -> str:
        engines = table(
            free_kv_blocks=40, holder_queue_s=holder_queue_s, release={"e1": release} if release else None
        )
        p = plan(64 * 32 + 300, 32, hits=32)
        HeldRouting(engines, mode="auto", profile=None, fabric="shm").apply(p, "e1", locality)
        assert p.kv.held is not None
        return p.kv.held.primitive

    assert choice(0.0, ([0.2], [64 * 64])) == "route"
    assert choice(0.05, ([0.2], [64 * 64])) == "fetch"
    assert choice(0.05, ([30.0], [64 * 64])) == "route"
    assert choice(0.05, None) == "route"
    # a burst: once the KV the router sent exceeds the free KV (a backlog), copies wait out of turn, even
    # with the holder busy and a release known
    engines = table(free_kv_blocks=40, holder_queue_s=0.05, release={"e1": ([0.2], [64 * 64])})
    routing = HeldRouting(engines, mode="auto", profile=None, fabric="shm")
    primitives = []
    for _ in range(3):
        p = plan(64 * 32 + 300, 32, hits=32)
        routing.apply(p, "e1", locality)
        assert p.kv.held is not None
        primitives.append(p.kv.held.primitive)
    assert primitives == ["fetch", "fetch", "route"]
    assert routing.free_kv_tokens("e1") == 40 * 64 - 2 * (2048 + 332) - 332 < 0
    aged = table(free_kv_blocks=40, release={"e1": ([0.2], [64])})
    state = aged.get("e1")
    assert state is not None
    state.report.sent_at -= 0.15
    ((at, tokens),) = HeldRouting(aged, mode="auto", profile=None, fabric="shm").kv_release("e1")
    assert tokens == 64 and 0.0 < at <= 0.05


def test_auto_prices_routes_at_what_the_requesters_routed_steps_measured() -> None:
    """A requester with room for one copy of the document but not two, 64 blocks coming back in 0.2 s: by
    the model alone (an idle holder) a sub-agent routes rather than wait. Once the requester's load report
    says its routed decoding steps took 60 ms of round trips (`route_step_s`: a loaded host, where the
    calibration saw 4 x ~0.5 ms), the excess over the model is priced on every exchange like a holder's
    queue, and waiting for the copy costs less; a step faster than the model adds nothing, and a holder's
    own queue is priced as before."""
    locality = {"held:e0": 32, "store": 32}

    def priced(route_step_s: float, holder_queue_s: float = 0.0) -> tuple[str, float]:
        release = {"e1": ([0.2], [64 * 64])}  # a running request gives 64 blocks back in 0.2 s
        engines = table(free_kv_blocks=40, holder_queue_s=holder_queue_s, release=release, decode_step_s=0.07)
        state = engines.get("e1")
        assert state is not None and state.report.route is not None
        state.report.route = dataclasses.replace(state.report.route, route_step_s=route_step_s)
        routing = HeldRouting(engines, mode="auto", profile=None, fabric="shm")
        profile = routing.route_profile()
        assert profile is not None
        p = plan(64 * 32 + 300, 32, hits=32)
        routing.apply(p, "e1", locality)
        assert p.kv.held is not None
        return p.kv.held.primitive, measured_delay_s(profile, profile.fabric("shm"), state.report.route, 2048)

    assert priced(0.0) == ("route", 0.0)
    primitive, delay_s = priced(0.06)
    assert primitive == "fetch" and 0.01 < delay_s < 0.015  # 15 ms per exchange less the model's price
    assert priced(0.001)[1] == 0.0  # faster than the model: no delay
    assert priced(0.0, holder_queue_s=0.05)[0] == "fetch"


def test_auto_prices_a_burst_in_view_at_the_waves_its_copies_would_queue_in() -> None:
    """Eight sub-agents of a 2048-token document planned together (the router's `undecided`: their index
    lookups were in flight at once) reach a requester whose whole cache, 128 blocks, holds three copies and
    which decodes a step in 30 ms. Alone, a sub-agent fetches while a copy fits beside room for one more;
    in view of the burst, copies would queue in waves of three, one stay (32 steps) apart, so the first
    routes. Each applied request leaves the burst, and the KV it keeps is noted with when it comes back as
    priced (its stay), which the next copies wait for. The burst is shared among the engines that can take
    it: with the holder a candidate too (its own compute), a requester's share of 7 others is 3; the routes
    it decided count on the holder (`holder_burst`) until the holder's next report."""
    locality = {"held:e0": 32, "store": 32}
    shared = {"e0": "cpu@a", "e1": "cpu@a"}

    def first_choice(burst: int) -> tuple[str, int, tuple[tuple[float, int], ...]]:
        engines = table(free_kv_blocks=128, compute=shared, decode_step_s=0.03)
        routing = HeldRouting(engines, mode="auto", profile=None, fabric="shm")
        plans = [plan(64 * 32 + 300, 32, hits=32, request_id=f"r{i}") for i in range(burst)]
        for p in plans:
            routing.undecided.add(p.request_id, p.kv.block_hashes)
        routing.apply(plans[0], "e1", locality)
        assert plans[0].kv.held is not None
        left = routing.undecided.sharing("r1", plans[0].kv.block_hashes, 32)
        return plans[0].kv.held.primitive, left, routing.kv_release("e1")

    primitive, _, ((at, tokens),) = first_choice(1)
    assert primitive == "fetch" and tokens == 2048 + 332 and 32 * 0.03 < at < 32 * 0.03 + 0.1
    primitive, left, ((at, tokens),) = first_choice(8)
    assert (primitive, left, tokens) == ("route", 6, 332)  # the first left the burst: 6 others remain
    routing = HeldRouting(table(free_kv_blocks=128), mode="auto", profile=None, fabric="shm")
    plans = [plan(64 * 32 + 300, 32, hits=32, request_id=f"r{i}") for i in range(8)]
    for p in plans:
        routing.undecided.add(p.request_id, p.kv.block_hashes)
    assert routing.avoid(locality, plans[0]) == set()
    assert routing.burst_share(plans[0], 32, locality) == 3
    # routes decided in the burst load the holder until its next report says so itself
    routing = HeldRouting(table(free_kv_blocks=128), mode="route", profile=None, fabric="shm")
    routing.apply(plans[0], "e1", locality)
    assert plans[0].kv.held is not None and plans[0].kv.held.primitive == "route"
    assert routing._routed_since_report("e0") == 1
    holder = routing.engines.get("e0")
    assert holder is not None
    routing.engines.update(dataclasses.replace(holder.report, seq=2), now=time.monotonic())
    assert routing._routed_since_report("e0") == 0


def test_auto_leaves_a_holder_that_shares_its_compute_to_the_engines_it_shares_with() -> None:
    """CPU engines of one host (one compute_id): a sub-agent on the holder would take cores from the
    requesters to save a fetch, so auto sends it elsewhere while another engine can take it; a holder on
    compute of its own (another GPU, or an engine that states none) stays a candidate."""
    locality = {"held:e0": 32, "store": 32}
    p = plan(64 * 32 + 300, 32, hits=32)
    shared = table(compute={"e0": "cpu@a", "e1": "cpu@a"})
    assert HeldRouting(shared, mode="auto", profile=None, fabric="shm").avoid(locality, p) == {"e0"}
    for compute in ({"e0": "cuda:GPU-0", "e1": "cuda:GPU-1"}, {"e0": "cpu@a", "e1": "cpu@b"}, {}):
        routing = HeldRouting(table(compute=compute), mode="auto", profile=None, fabric="shm")
        assert routing.avoid(locality, p) == set(), compute
    alone = table(compute={"e0": "cpu@a"})  # nothing else computes on cpu@a
    assert not HeldRouting(alone, mode="auto", profile=None, fabric="shm").shares_compute("e0")


def pinned(prompt_tokens: int, name: str = "repo", tenant: str = "t") -> RequestPlan:
    p = plan(prompt_tokens, 4)
    p.pin = ChunkName(name=name, tenant=tenant)
    return p


def test_a_request_naming_a_chunk_goes_to_a_holder_of_its_prefix_else_where_its_name_went() -> None:
    routing = HeldRouting(table(holds=("e0", "e1")), mode="route", profile=None, fabric="shm")
    p = pinned(64 * 4 + 10)
    assert routing.avoid({"held:e1": 4}, p) == {"e0"}  # e1 holds its whole prefix
    assert routing.avoid({"held:e1": 3}, p) == set()  # a part only: any holder
    routing.apply(p, "e0", {"held:e1": 3})
    assert p.kv.held is None  # the chunk's source is never routed, fetched or recomputed elsewhere
    assert routing.avoid({}, pinned(64 * 9)) == {"e1"}  # the name went to e0: a new version goes there too
    assert routing.avoid({}, pinned(64 * 9, tenant="other")) == set()  # names are per tenant
    assert routing.avoid({"held:e1": 4}, plan(64 * 4 + 10, 4)) == {"e1"}  # unnamed: the forced mode's rule


def test_a_request_naming_a_chunk_avoids_engines_that_cannot_hold_and_fails_without_any() -> None:
    routing = HeldRouting(table(holds=("e1",)), mode="auto", profile=None, fabric="shm")
    assert routing.avoid({}, pinned(200)) == {"e0"}
    with pytest.raises(NoEngineAvailableError, match="kv_chunk"):
        HeldRouting(table(), mode="auto", profile=None, fabric="shm").avoid({}, pinned(200))

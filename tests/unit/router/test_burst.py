"""A burst of sub-agents at the router: requests whose index lookups are in flight together are counted as
undecided (`services/router/kv_plan.py`, `Undecided`) under their block hashes, so the move-the-query
routing sees the others that share its chunk (`kvpath_router_movequery_burst_size`); a request leaves
once its plan is applied, or when it failed before that. Real nats-server; the index is a stand-in
responder on its subject that holds its replies until every lookup of the burst has arrived (the overlap a
burst has, made certain). And the requester's measured routed step that prices routes."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import REGISTRY

from services.engine.route_exchange import StepMeter
from services.router.kv_plan import KvPlanner, PlannedKv, Undecided
from services.router.route_choice import HeldRouting
from shared.bus import Bus, MsgContext
from shared.hashing import block_hashes
from shared.natsserver import NatsServer
from shared.protocol.kv import IndexMatchReply, IndexMatchRequest
from tests.unit.router.test_route_choice import FMT, plan, table

DOC_BLOCKS = 32


async def test_requests_planned_together_count_as_one_burst_until_each_is_applied(
    nats_server: NatsServer, namespace: str
) -> None:
    rng = random.Random(7)
    doc = [rng.randrange(3, 250) for _ in range(64 * DOC_BLOCKS)]
    agents = [doc + [rng.randrange(3, 250) for _ in range(100 + 50 * i)] for i in range(3)]
    other = [rng.randrange(3, 250) for _ in range(64 * DOC_BLOCKS + 100)]  # a prompt of another document
    doc_hashes = block_hashes(doc, 64, FMT.fingerprint)
    arrived: list[int] = []
    all_arrived = asyncio.Event()

    async def index(msg: IndexMatchRequest, ctx: MsgContext) -> IndexMatchReply:
        arrived.append(len(msg.block_hashes))
        if len(arrived) == 4:
            all_arrived.set()
        await asyncio.wait_for(all_arrived.wait(), 10)
        held = DOC_BLOCKS if msg.block_hashes[DOC_BLOCKS - 1] == doc_hashes[-1] else 0
        return IndexMatchReply(num_hit_blocks=held, per_location={"held:e0": held, "store": held})

    bus = Bus(nats_server.url, namespace, name="t")
    await bus.connect()
    try:
        await bus.subscribe(bus.subjects.index_match, IndexMatchRequest, index, max_concurrency=8)
        routing = HeldRouting(table(free_kv_blocks=128), mode="auto", profile=None, fabric="shm")
        planner = KvPlanner(bus, use_index=True, timeout_s=10.0)
        planner.undecided = routing.undecided
        ids = [f"a{i}" for i in range(3)] + ["o"]
        planned: list[PlannedKv] = await asyncio.gather(
            *(planner.plan(p, FMT, rid) for p, rid in zip([*agents, other], ids, strict=True))
        )
        assert sorted(arrived) == sorted(len(p.kv.block_hashes) for p in planned)  # 4 lookups at once
        hashes = [p.kv.block_hashes for p in planned]
        undecided = routing.undecided
        assert [undecided.sharing(rid, h, DOC_BLOCKS) for rid, h in zip(ids, hashes, strict=True)] == [
            2,
            2,
            2,
            0,
        ]
        assert undecided.sharing("a0", hashes[0], len(hashes[0])) == 0  # beyond the document they differ

        request = plan(len(agents[0]), 32, hits=DOC_BLOCKS, request_id="a0")
        request.kv = planned[0].kv
        seen = REGISTRY.get_sample_value("kvpath_router_movequery_burst_size_sum") or 0.0
        routing.apply(request, "e1", planned[0].blocks_by_location)
        assert REGISTRY.get_sample_value("kvpath_router_movequery_burst_size_sum") == seen + 2
        assert request.kv.held is not None and request.kv.held.holder_id == "e0"
        assert undecided.sharing("a1", hashes[1], DOC_BLOCKS) == 1  # a0 is decided
        planner.decided("a2")  # failed before its dispatch
        assert undecided.sharing("a1", hashes[1], DOC_BLOCKS) == 0
    finally:
        await bus.close()


def test_a_request_still_undecided_long_after_its_lookup_is_dropped() -> None:
    """Dropped when counting and when adding: a router whose dispatch never applies a plan (nothing prices
    a burst there) keeps no more than its recent requests."""
    undecided = Undecided(max_age_s=-1.0)  # everything already stale
    undecided.add("a", [1, 2, 3])
    undecided.add("b", [1, 2, 3])
    assert len(undecided) == 1  # "a" went when "b" came
    assert undecided.sharing("c", [1, 2, 3], 3) == 0 and len(undecided) == 0
    kept = Undecided(max_age_s=60.0)
    kept.add("a", [1, 2, 3])
    kept.add("b", [1, 2, 9])
    kept.add("", [])  # nothing to share: not counted
    assert (kept.sharing("c", [1, 2, 3], 2), kept.sharing("c", [1, 2, 3], 3), kept.sharing("c", [1], 2)) == (
        2,
        1,
        0,
    )


def test_a_requesters_routed_steps_are_averaged_and_forgotten_after_a_quiet_spell() -> None:
    meter = StepMeter(weight=0.5, ttl_s=60.0)
    assert meter.value == 0.0
    meter.add(0.0)  # a step with no round trip measured: nothing
    meter.add(0.04)
    meter.add(0.02)
    assert meter.value == pytest.approx(0.03)
    quiet = StepMeter(ttl_s=0.0)
    quiet.add(0.04)
    assert quiet.value == 0.0

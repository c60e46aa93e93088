"""The move-the-query cost model against the paper's own arithmetic (brief §8.1: exact numbers, the
crossovers, the rules of thumb), the request-level predicate and the between-steps re-evaluation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.policy.movequery import (
    Fabric,
    ModelShape,
    Primitive,
    RouteRequest,
    burst_wait_s,
    byte_break_even_rows,
    can_take_chunk,
    choose,
    fetch_s,
    holder_burst_s,
    keep_routing,
    local_attention_s,
    local_fetch_crossover_tokens,
    local_s,
    memory_need_tokens,
    memory_wait_s,
    request_costs,
    resident_kv_tokens,
    route_exchange_s,
    route_fetch_crossover_rows,
)
from services.policy.movequery_profile import (
    IBGDA_TURNAROUND_S,
    PAPER_FABRICS,
    V2_LITE,
    fallback_profile,
    paper_profile,
    profile_from_dict,
    profile_to_dict,
)
from shared.errors import ConfigError

US = 1e-6


def test_mla_payload_and_the_byte_crossover() -> None:
    assert (V2_LITE.query_bytes_per_row, V2_LITE.partial_bytes_per_row, V2_LITE.row_bytes) == (
        1152,
        1032,
        2184,
    )
    chunk_layer_bytes = 2048 * V2_LITE.kv_bytes_per_token_layer
    assert chunk_layer_bytes == 2_359_296  # 2.36 MB one layer; x27 = 63.7 MB
    assert chunk_layer_bytes * V2_LITE.num_layers / 1e6 == pytest.approx(63.7, abs=0.05)
    assert [round(byte_break_even_rows(V2_LITE, c)) for c in (2048, 1024, 512)] == [1080, 540, 270]
    assert 1 - 256 * V2_LITE.row_bytes / chunk_layer_bytes == pytest.approx(0.763, abs=5e-4)  # "76%"


def test_route_model_at_the_papers_points() -> None:
    profile = paper_profile()
    ibgda = PAPER_FABRICS["ibgda"]
    assert route_exchange_s(profile, ibgda, 1024, 2048) / US == pytest.approx(105.5, abs=0.1)
    measured = 115.8 * US  # Table 1: the model is 9% under, the missing turnaround
    assert 0.08 < 1 - route_exchange_s(profile, ibgda, 1024, 2048) / measured < 0.10
    with_turn = Fabric("ibgda+turn", 16e-6, 24.7e9, IBGDA_TURNAROUND_S)
    assert route_exchange_s(profile, with_turn, 1024, 2048) / US == pytest.approx(115.9, abs=0.5)
    decode = {name: route_exchange_s(profile, f, 256, 2048) / US for name, f in PAPER_FABRICS.items()}
    assert min(decode.values()) == pytest.approx(27.8, abs=0.1) and max(decode.values()) == pytest.approx(
        38.4, abs=0.1
    )
    assert max(decode.values()) / min(decode.values()) < 1.5  # the fabrics cluster within 1.5x at decode
    splice = profile.compute.splice_s
    assert splice / (115.8 * US) == pytest.approx(26, abs=0.5)  # "~26x cheaper at M_q = 1024"
    assert 60 < splice / (48 * US) and splice / (31 * US) < 100  # "60-100x below the splice" at decode


def test_crossovers() -> None:
    ibgda = PAPER_FABRICS["ibgda"]
    nvl4 = PAPER_FABRICS["h100-nvlink4"]
    crossover = (ibgda.t_probe_s - nvl4.t_probe_s) / (V2_LITE.row_bytes * (1 / 21e9 - 1 / 25e9))
    assert crossover == pytest.approx(890, abs=5)  # NVLink leads IBGDA only up to ~1000 rows
    for c_s, want in ((1.5e-6, 74), (0.5e-6, 222)):  # fetch/local: "75-220 tokens" (splice alone)
        free_pull = dataclasses.replace(paper_profile(c_s=c_s), fetch_bandwidth_bytes_per_s=math.inf)
        assert local_fetch_crossover_tokens(free_pull) == pytest.approx(want, abs=1)
    with_pull = local_fetch_crossover_tokens(paper_profile(c_s=0.5e-6, pull_fabric="ibgda"))
    assert 222 < with_pull < 250  # the pull moves the upper end up a little (brief §4.2)
    rows = route_fetch_crossover_rows(paper_profile(), ibgda, 2048)  # with the 2.5 ms pull: ~6.3e4
    assert rows == pytest.approx(6.3e4, rel=0.02)
    assert rows > 10 * 256  # far above any decode batch
    local_2k = [local_s(paper_profile(c_s=c), 2048) for c in (0.5e-6, 1.5e-6)]  # "tens of ms"
    assert local_2k[0] == pytest.approx(27.6e-3, rel=0.01) and local_2k[1] == pytest.approx(82.9e-3, rel=0.01)
    assert fetch_s(paper_profile(), 2048) == pytest.approx(3e-3 + 2.55e-3, rel=0.01)
    threshold = 256 * V2_LITE.row_bytes / 3e-3  # congestion: route loses only below ~0.19 GB/s
    assert threshold / 1e9 == pytest.approx(0.186, abs=0.001)


def test_the_predicate_per_request() -> None:
    profile = paper_profile(with_compute=True)
    decode_only = RouteRequest(chunk_tokens=2048, new_tokens=1, decode_steps=1)
    for fabric in PAPER_FABRICS.values():  # route at decode on every fabric
        assert choose(profile, fabric, decode_only).primitive is Primitive.ROUTE
    small = RouteRequest(chunk_tokens=16, new_tokens=1, decode_steps=1)  # cheaper to recompute than 27 trips
    assert choose(profile, PAPER_FABRICS["ibgda"], small).primitive is Primitive.LOCAL
    # every layer of every step pays a round trip: many steps amortise a fetch (brief §9.2)...
    long_answer = RouteRequest(chunk_tokens=2048, new_tokens=64, decode_steps=400)
    assert choose(profile, PAPER_FABRICS["ibgda"], long_answer).primitive is Primitive.FETCH
    # ...unless the chunk does not fit the requester's free cache: only route needs no room for it
    tight = RouteRequest(chunk_tokens=2048, new_tokens=64, decode_steps=400, free_kv_tokens=1000)
    choice = choose(profile, PAPER_FABRICS["ibgda"], tight)
    assert choice.primitive is Primitive.ROUTE and math.isinf(choice.costs_s["fetch"])
    # a holder whose queue grew makes route lose where it won
    queued = RouteRequest(chunk_tokens=2048, new_tokens=1, decode_steps=8, holder_queue_s=5e-3)
    assert choose(profile, PAPER_FABRICS["ibgda"], queued).primitive is Primitive.FETCH
    no_store = RouteRequest(
        chunk_tokens=2048, new_tokens=1, decode_steps=8, holder_queue_s=5e-3, can_fetch=False
    )
    assert choose(profile, PAPER_FABRICS["ibgda"], no_store).primitive is Primitive.LOCAL
    gone = RouteRequest(chunk_tokens=2048, new_tokens=1, decode_steps=1, can_route=False)
    assert choose(profile, PAPER_FABRICS["ibgda"], gone).primitive is Primitive.FETCH
    nothing = RouteRequest(chunk_tokens=2048, new_tokens=1, decode_steps=1, can_route=False, can_fetch=False)
    assert choose(profile, PAPER_FABRICS["ibgda"], nothing).primitive is Primitive.LOCAL


def test_memory_bound_requester_waits_for_room_or_routes_whichever_costs_less() -> None:
    """The fan-in's memory rule on a hand-made requester: fetch wins on time while its free KV holds this
    sub-agent's copy of the chunk and one more; short of that, fetch pays the wait until the running requests
    have released the shortfall (the requester's release schedule), and route wins once that wait costs more
    than routing; with nothing known of the releases only route, which keeps its own tokens, is priced."""
    profile, ibgda = paper_profile(with_compute=True), PAPER_FABRICS["ibgda"]
    sub_agent = RouteRequest(chunk_tokens=2048, new_tokens=64, decode_steps=400)
    assert resident_kv_tokens(Primitive.ROUTE, sub_agent) == memory_need_tokens("route", sub_agent) == 464
    assert resident_kv_tokens("fetch", sub_agent) == resident_kv_tokens("local", sub_agent) == 2512
    assert memory_need_tokens("fetch", sub_agent) == memory_need_tokens("local", sub_agent) == 2512 + 2048
    roomy = dataclasses.replace(sub_agent, free_kv_tokens=2512 + 2048)
    assert can_take_chunk(roomy) and choose(profile, ibgda, roomy).primitive is Primitive.FETCH
    # in view of a burst, a copy is free of waits only while every copy of the burst fits
    assert not can_take_chunk(dataclasses.replace(roomy, pending_requests=1))
    assert can_take_chunk(dataclasses.replace(roomy, pending_requests=1, free_kv_tokens=2 * 2512 + 2048))
    one_copy = dataclasses.replace(sub_agent, free_kv_tokens=2512 + 2047)  # this one fits, the next not
    choice = choose(profile, ibgda, one_copy)
    assert not can_take_chunk(one_copy) and choice.primitive is Primitive.ROUTE
    assert math.isinf(choice.costs_s["fetch"]) and math.isinf(choice.costs_s["local"])
    # a holder so busy that routing costs 2 s more than fetching
    busy = dataclasses.replace(one_copy, holder_queue_s=2.0 / (27 * 400))
    gap = choose(profile, ibgda, busy).costs_s["route"] - choose(profile, ibgda, roomy).costs_s["fetch"]
    assert 1.9 < gap < 2.2
    soon = dataclasses.replace(busy, kv_release=((0.5, 3000),))  # a running request frees 3000 tokens soon
    choice = choose(profile, ibgda, soon)
    assert choice.primitive is Primitive.FETCH  # it waits for that room, priced exactly that long
    assert choice.ttft_s["fetch"] == pytest.approx(choose(profile, ibgda, roomy).ttft_s["fetch"] + 0.5)
    late = dataclasses.replace(busy, kv_release=((3.0, 3000),))  # ...or late: routing costs less
    assert choose(profile, ibgda, late).primitive is Primitive.ROUTE
    # the queued work goes first: 300 tokens owed; releases of 1000 tokens at 0.1 and 0.2 s
    queued = dataclasses.replace(sub_agent, free_kv_tokens=-300, kv_release=((0.1, 1000), (0.2, 1000)))
    assert memory_wait_s(queued, 464) == 0.1  # route: 764 short
    assert memory_wait_s(queued, 4560) == pytest.approx(0.2 * 4860 / 2000)  # past the schedule: its pace
    assert memory_wait_s(dataclasses.replace(queued, kv_release=()), 464) == math.inf
    # nothing known: route needs the least memory, so it goes first
    assert choose(profile, ibgda, dataclasses.replace(queued, kv_release=())).primitive is Primitive.ROUTE
    # without a holder nothing avoids memory: time decides again (fetch), the engine queues it
    unrouted = dataclasses.replace(queued, kv_release=(), can_route=False)
    assert choose(profile, ibgda, unrouted).primitive is Primitive.FETCH


def test_a_burst_is_priced_at_the_waves_it_would_queue_in() -> None:
    """A sub-agent with 9 others of its burst still undecided, into a cache of 7,000 KV tokens (room for 2
    copies of 2,512 or 15 routed sub-agents of 464): were all 10 to take a copy, 2 start now and the rest in
    waves of 2, one stay apart (the first wave once the burst's own first copies end, since nothing running
    releases sooner); routed, all 10 fit at once. The burst's mean wait enters the price, so the burst routes
    where each sub-agent alone would have fetched; a burst that fits (or one alone) waits for nothing."""
    profile, ibgda = paper_profile(with_compute=True), PAPER_FABRICS["ibgda"]
    alone = RouteRequest(
        chunk_tokens=2048, new_tokens=64, decode_steps=400, free_kv_tokens=7000, kv_capacity_tokens=7000,
        decode_step_s=0.02,
    )  # fmt: skip
    burst = dataclasses.replace(alone, pending_requests=9)
    # waits 0, 0, then 2 each at 1, 2, 3, 4 stays: (2 + 4 + 6 + 8) x stay / 10
    assert burst_wait_s("fetch", burst, 8.0) == pytest.approx(20 * 8.0 / 10)
    assert burst_wait_s("route", burst, 9.0) == 0.0
    # a running request that frees a copy's room at 1 s starts the first wave then, not after a stay
    released = dataclasses.replace(burst, free_kv_tokens=5100, kv_release=((1.0, 3000),))
    assert burst_wait_s("fetch", released, 8.0) == pytest.approx((1 + 1 + 9 + 9 + 17 + 17 + 25 + 25) / 10)
    assert burst_wait_s("fetch", dataclasses.replace(burst, pending_requests=1), 8.0) == 0.0
    assert choose(profile, ibgda, alone).primitive is Primitive.FETCH
    assert choose(profile, ibgda, burst).primitive is Primitive.ROUTE
    # a backlog with the burst in view: copies are priced at their waves, not ruled out
    behind = dataclasses.replace(burst, free_kv_tokens=-100, kv_release=((0.5, 7100),))
    assert math.isfinite(choose(profile, ibgda, behind).costs_s["fetch"])
    unseen = dataclasses.replace(behind, pending_requests=None)  # a caller that cannot see bursts
    assert math.isinf(choose(profile, ibgda, unseen).costs_s["fetch"])


def test_a_bursts_other_routes_queue_on_the_holder() -> None:
    """Were a burst to route, the holder attends every sub-agent's prefill rows over the chunk (half the
    others' before this one's, on average) and every routed row at each decoding step. A holder on a CPU
    (this host's calibration: ~1 ns per row x key) turns a 15-sub-agent burst's route from the cheapest
    primitive into one dearer than a fetch; to the paper's GPU holder it adds a few percent of a 400-token
    answer's route; alone (no burst) nothing is added."""
    cpu = fallback_profile(ModelShape(4, 8, 128, 136, 512))
    cpu = dataclasses.replace(
        cpu,
        compute=dataclasses.replace(cpu.compute, attention_s_per_row_key=9.2e-10, attention_s_per_key=2.8e-8),
    )
    shm = cpu.fabric("shm")
    alone = RouteRequest(chunk_tokens=2048, new_tokens=300, decode_steps=16, free_kv_tokens=8192)
    burst = dataclasses.replace(alone, pending_requests=7, holder_burst=15, kv_capacity_tokens=8192)
    prefill_s, decode_s = holder_burst_s(cpu, burst)
    assert prefill_s == pytest.approx(15 * 4 * local_attention_s(cpu, 300 * 8, 2048) / 2)
    assert decode_s == pytest.approx(15 * 15 * 4 * 9.2e-10 * 8 * 2048)
    total, first = request_costs(cpu, shm, burst)
    bare_total, bare_first = request_costs(cpu, shm, dataclasses.replace(burst, holder_burst=0))
    assert first["route"] - bare_first["route"] == pytest.approx(prefill_s)
    assert total["route"] - bare_total["route"] == pytest.approx(prefill_s + decode_s)
    assert choose(cpu, shm, dataclasses.replace(burst, holder_burst=0)).primitive is Primitive.ROUTE
    assert choose(cpu, shm, burst).primitive is Primitive.FETCH
    unseen = dataclasses.replace(burst, pending_requests=None)  # a caller that sees no burst adds nothing
    assert request_costs(cpu, shm, unseen)[0]["route"] == pytest.approx(
        request_costs(cpu, shm, alone)[0]["route"]
    )
    gpu = paper_profile(with_compute=True)
    long = dataclasses.replace(alone, decode_steps=400)
    added = sum(holder_burst_s(gpu, dataclasses.replace(burst, decode_steps=400)))
    assert 0 < added < 0.05 * request_costs(gpu, PAPER_FABRICS["ibgda"], long)[0]["route"]


def test_keep_routing_between_steps() -> None:
    profile, ibgda = paper_profile(with_compute=True), PAPER_FABRICS["ibgda"]
    assert keep_routing(profile, ibgda, chunk_tokens=2048, remaining_steps=3)
    assert not keep_routing(profile, ibgda, chunk_tokens=2048, remaining_steps=500)
    # the holder's queue (measured) reprices it: a few steps left still flip when each costs 50 ms
    assert not keep_routing(profile, ibgda, chunk_tokens=2048, remaining_steps=3, measured_step_s=0.05)


def test_profile_file_form_round_trips_and_is_checked() -> None:
    profile = fallback_profile(V2_LITE)
    data = profile_to_dict(profile, model="m", fingerprint="f")
    assert data["model"] == "m" and profile_from_dict(data) == profile
    with pytest.raises(ConfigError, match="not a move-the-query profile"):
        profile_from_dict({"kind": "other"})
    broken = dict(data, fabrics={"shm": {"t_probe_s": 1e-4}})
    with pytest.raises(ConfigError, match="malformed"):
        profile_from_dict(broken)
    with pytest.raises(ConfigError):
        profile_from_dict(dict(data, fabrics={"shm": {"t_probe_s": 1e-4, "bandwidth_bytes_per_s": 0}}))

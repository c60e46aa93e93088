"""The Beluga simulator's cost terms against hand-computed values, its data paths on an idle clock, and the
prefix tiers (chain matching, deduplicated stores, LRU eviction around pins)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from loadgen.sim.events import EventLoop
from loadgen.sim.pool.compute import StepModel
from loadgen.sim.pool.costs import GB, CxlCosts, KvGeometry, RdmaCosts, hit_cap_tokens, whole_units
from loadgen.sim.pool.paths import CxlPath, RdmaPath
from loadgen.sim.pool.tiers import DOC, OWN, PrefixTier, UnitRange, split_units
from loadgen.sim.pool.workload import LvRequest

MIB = 1 << 20
GEOMETRY = KvGeometry()
Done = Callable[[], None]


def test_qwen32b_geometry() -> None:
    # 2 x 64 layers x 8 KV heads x 128 x 2 B; a 16-token block is 128 chunks (paper) of 32 KiB, 4 MiB in all
    assert GEOMETRY.kv_bytes_per_token == 262_144
    assert GEOMETRY.chunks_per_block == 128
    assert 16 * GEOMETRY.kv_bytes_per_token == 4 * MIB


def test_whole_units_and_the_hit_cap() -> None:
    assert whole_units(20_000, 256) == 78 and whole_units(20_000, 16) == 1250
    # the last prompt token is always computed: 19,999 tokens can hit, in whole units
    assert hit_cap_tokens(20_000, 16) == 1249 * 16 == 19_984
    assert hit_cap_tokens(20_000, 256) == 78 * 256 == 19_968
    assert hit_cap_tokens(20_001, 16) == 20_000
    assert hit_cap_tokens(1, 16) == 0


def test_beluga_load_and_store_fixed_terms() -> None:
    cxl = CxlCosts()
    # LOOKUP + UNPIN RPCs, one kernel launch, 12 ns per chunk: 100 blocks x 128 chunks
    expected = 2 * 2.11e-6 + 8e-6 + 100 * 128 * 12e-9
    assert cxl.load_fixed_s(100, 128) == pytest.approx(expected)
    assert expected == pytest.approx(165.82e-6)
    assert cxl.store_fixed_s(100, 128) == pytest.approx(expected)  # ALLOC + COMMIT instead
    assert cxl.load_fixed_s(0, 128) == 0.0  # nothing hit: no lookup round trip charged
    # the launch is paid once, however many blocks: twice the blocks add only chunk time
    assert cxl.load_fixed_s(200, 128) - cxl.load_fixed_s(100, 128) == pytest.approx(100 * 128 * 12e-9)


def test_baseline_work_requests_and_object_costs() -> None:
    rdma = RdmaCosts(object_overhead_s=0.045, copy_bytes_per_s=0.8 * GB)
    assert rdma.wrs_per_object(128) == 5  # 30 SGEs per WR: 30 + 30 + 30 + 30 + 8
    assert rdma.wrs_per_object(30) == 1 and rdma.wrs_per_object(31) == 2
    assert rdma.wr_s * math.ceil(16_384 / 30) == pytest.approx(5260e-6, rel=0.01)  # Table 6, Qwen3-32B
    pool_object = 0.045 + 8e-6 + 8.39e-6 + 5 * 9.62e-6
    local_object = 0.045 + 8e-6  # the local DRAM tier: no metadata RPC, no work requests
    assert rdma.object_fixed_s(128, is_remote_tier=True) == pytest.approx(pool_object)
    assert rdma.object_fixed_s(128, is_remote_tier=False) == pytest.approx(local_object)
    size = 4 * 256 * GEOMETRY.kv_bytes_per_token  # four 256-token objects
    expected = 3 * pool_object + local_object + size / 0.8e9
    assert rdma.load_fixed_s(3, 1, 128, size) == pytest.approx(expected)
    assert rdma.store_fixed_s(4) == pytest.approx(4 * 8e-6)  # the put itself runs in the background


def _timed(start: Callable[[EventLoop, Done], None]) -> float:
    """When the transfers `start` begins on an idle clock end."""
    loop = EventLoop()
    finished: list[float] = []
    start(loop, lambda: finished.append(loop.now))
    loop.run()
    assert len(finished) == 1
    return finished[0]


def test_a_beluga_load_alone_is_its_fixed_terms_plus_the_adapter() -> None:
    cxl = CxlCosts()
    ranges = [UnitRange((DOC, 7), 0, 100)]

    def start(loop: EventLoop, done: Done) -> None:
        path = CxlPath(loop, cxl, GEOMETRY, 2, 8, is_interleaved=True)
        path.store(0, 1, ranges, lambda: path.load(1, 5, ranges, done))

    bytes_ = 100 * 4 * MIB
    fixed = cxl.load_fixed_s(100, 128)
    store_s = cxl.store_fixed_s(100, 128) + bytes_ / 26e9
    # each of 32 devices moves 1/32 at 22.5 GB/s, well under the adapter's 26 GB/s for the whole
    assert _timed(start) == pytest.approx(store_s + fixed + bytes_ / 26e9)


def test_without_interleaving_one_device_limits_a_load() -> None:
    cxl = CxlCosts()
    ranges = [UnitRange((DOC, 7), 0, 100)]

    def start(loop: EventLoop, done: Done) -> None:
        path = CxlPath(loop, cxl, GEOMETRY, 2, 8, is_interleaved=False)
        path.store(0, 0, ranges, lambda: path.load(0, 0, ranges, done))

    bytes_ = 100 * 4 * MIB  # all on device 0 (22.5 GB/s < the adapter's 26 GB/s)
    expected = 2 * cxl.store_fixed_s(100, 128) + 2 * bytes_ / 22.5e9
    assert _timed(start) == pytest.approx(expected)


def test_a_baseline_load_pays_per_object_then_pcie() -> None:
    rdma = RdmaCosts(object_overhead_s=0.045, copy_bytes_per_s=0.8 * GB)
    pool = [UnitRange((DOC, 3), 0, 4)]

    def start(loop: EventLoop, done: Done) -> None:
        RdmaPath(loop, rdma, GEOMETRY, 2, 8).load(0, 2, pool, [], done)

    size = 4 * 256 * GEOMETRY.kv_bytes_per_token  # 256 MiB: PCIe (55.4 GB/s) is the slowest link
    expected = rdma.load_fixed_s(4, 0, 128, size) + size / 55.4e9
    assert _timed(start) == pytest.approx(expected)


def _request(rid: int = 1, doc: int = 9) -> LvRequest:
    """A 1,000-token document and a 1,100-token prompt."""
    return LvRequest(request_id=rid, doc_id=doc, doc_tokens=1000, prompt_tokens=1100, output_tokens=4)


def test_units_of_a_prompt_split_into_document_and_own_segments() -> None:
    request = _request()  # 1000-token document: 62 blocks; 1100-token prompt: 68 blocks, 6 its own
    assert split_units(request, 16, 60, 65) == [UnitRange((DOC, 9), 60, 2), UnitRange((OWN, 1), 0, 3)]
    # 256-token objects: only 3 whole ones in the document, 1 of the prompt's own (tokens 768..1023)
    assert split_units(request, 256, 0, 4) == [UnitRange((DOC, 9), 0, 3), UnitRange((OWN, 1), 0, 1)]


def test_a_tier_matches_prefixes_and_stores_each_unit_once() -> None:
    tier = PrefixTier("t", capacity_units=1000, unit_tokens=16)
    first, second = _request(rid=1), _request(rid=2)
    assert tier.store(first, 500) == [UnitRange((DOC, 9), 0, 31)]
    assert tier.match_tokens(second) == 31 * 16  # the document's stored part serves another question
    assert tier.store(first, 1100) == [UnitRange((DOC, 9), 31, 31), UnitRange((OWN, 1), 0, 6)]
    assert tier.store(second, 1100) == [UnitRange((OWN, 2), 0, 6)]  # the document is not written twice
    assert tier.match_units(second) == 68 and tier.used_units == 74


def test_eviction_is_lru_over_unpinned_segments() -> None:
    tier = PrefixTier("t", capacity_units=140, unit_tokens=16)
    old, pinned, new = _request(rid=1, doc=1), _request(rid=2, doc=2), _request(rid=3, doc=3)
    tier.store(old, 1100)
    tier.pin(pinned)
    tier.store(pinned, 1100)
    tier.store(new, 1100)  # 3 x 68 units > 140: the oldest unpinned ones go
    assert tier.match_units(old) == 0 and tier.match_units(pinned) == 68 and tier.match_units(new) == 68
    tier.unpin(pinned)
    tier.store(_request(rid=4, doc=4), 1100)
    assert tier.match_units(pinned) == 0  # unpinned, now the least recently used


def test_step_model_prefill_and_decode() -> None:
    model = StepModel()
    assert model.step_s([], []) == 0.0
    # a 2,048-token chunk at 105 TFLOP/s: 2 x 32.8e9 x 2048 linear FLOPs plus the causal attention
    attention = 4 * 64 * 128 * (2048 * 2049 / 2) * 64
    expected = 0.005 + 2 * 32.8e9 * 2048 / 105e12 + attention / 105e12
    assert model.step_s([(0, 2048)], []) == pytest.approx(expected)
    # decode is memory-bound: the 60 GB of weights plus every sequence's KV, from 4 TB/s HBM
    decode = 0.005 + 60e9 / 4e12 + 2 * 20_000 * 262_144 / 4e12
    assert model.step_s([], [20_000, 20_000]) == pytest.approx(decode)

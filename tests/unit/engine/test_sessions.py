"""AMPD on the engine, pure parts: the session cache (resident KV between turns, evicted idle-longest first
through the scheduler's allocator) and Algorithm 2 ordering the scheduler's waiting queue."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from services.engine.scheduler import EngineScheduler
from services.engine.sequence import Sequence
from services.engine.sessions import ResidentKv, SessionAllocator, SessionCache, common_prefix
from services.engine.slo_order import SloPrefillOrder
from services.policy.ampd_costs import linear_cost_model
from shared.protocol import RequestPlan, SamplingParams
from tests.unit.engine.test_scheduler import FreeList


def entry(session: str, blocks: list[int], tokens: int = 8) -> ResidentKv:
    return ResidentKv(session, list(range(tokens)), blocks, [])


def test_the_allocator_counts_resident_blocks_as_free_and_evicts_idle_longest_first() -> None:
    kv = FreeList(10)
    cache = SessionCache(kv, announcer=None)
    cache.keep(entry("old", kv.allocate(3)))
    cache.keep(entry("new", kv.allocate(3)))
    alloc = SessionAllocator(kv, cache)
    assert alloc.num_free_blocks == 10 and kv.num_free_blocks == 4
    assert len(alloc.allocate(6)) == 6  # 2 short: "old" goes, "new" stays
    assert cache.get("old") is None and cache.get("new") is not None and cache.num_blocks == 3


def test_a_taken_session_is_not_evicted_and_a_shorter_keep_loses() -> None:
    kv = FreeList(10)
    cache = SessionCache(kv, announcer=None)
    cache.keep(entry("s", kv.allocate(4), tokens=16))
    taken = cache.take("s")
    assert taken is not None and cache.evict(10) == 0  # the turn holds its blocks now
    cache.keep(taken)
    assert not cache.keep(entry("s", kv.allocate(2), tokens=8))  # older, shorter: freed
    assert cache.num_blocks == 4 and kv.num_free_blocks == 6


@pytest.mark.parametrize(
    ("a", "b", "n"), [([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([], [1], 0), ([5], [6], 0)]
)
def test_common_prefix(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix(a, b) == n


def test_common_prefix_of_block_hashes_takes_the_whole_uint64_range() -> None:
    high = (1 << 64) - 1  # past int64: hashes compare as uint64
    assert common_prefix([high, 7, 1], [high, 7, 2], dtype=np.uint64) == 2
    assert common_prefix([high, 1 << 63], [high, 1 << 63], dtype=np.uint64) == 2


def _seq(rid: str, n_prompt: int, arrived_at: float, ttft_slo_s: float) -> Sequence:
    plan = RequestPlan(
        request_id=rid,
        router_id="r",
        prompt_token_ids=list(range(n_prompt)),
        sampling=SamplingParams(max_tokens=4),
        deadline_unix_s=1e12,
        ttft_slo_s=ttft_slo_s,
    )
    return Sequence(plan=plan, arrived_at=arrived_at)


def test_the_scheduler_admits_the_order_algorithm_2_picks() -> None:
    costs = linear_cost_model(
        prefill_tokens_per_s=100.0, decode_step_s=0.0, kv_bytes_per_token=1, link_bytes_per_s={}
    )
    order = SloPrefillOrder(
        lambda: costs, kind="prefill", window=3, default_ttft_slo_s=1.0, clock=lambda: 10.0
    )
    # FCFS would run a hopeless task (waited past its SLO) first and then miss a short one with a tight SLO;
    # Algorithm 2 runs the short one first, and the long one still makes it after the hopeless one
    hopeless, long, short = _seq("h", 40, 0.0, 1.0), _seq("l", 100, 10.0, 2.0), _seq("s", 40, 9.9, 0.6)
    waiting = deque([hopeless, long, short])
    order(waiting, 0)
    assert [s.request_id for s in waiting] == ["s", "h", "l"]
    assert (hopeless.num_postponed, long.num_postponed, short.num_postponed) == (1, 1, 0)
    sched = EngineScheduler(FreeList(400), block_size=4, max_num_seqs=1, max_num_batched_tokens=1000)
    sched.prefill_order = order
    for s in (_seq("h2", 40, 0.0, 1.0), _seq("s2", 40, 9.9, 0.6)):
        sched.add(s)
    plan = sched.schedule()
    assert [c.seq.request_id for c in plan.prefill] == ["s2"]

"""`--policy auto` on prefill/decode engines with a KV pool: the pool is offered when the index places the
prompt's prefix in one (`cxl:<pool>`), and the chosen pool plan tells the engine that prefills to read the
pool first (read side `pool`, storage below it): the decode engine on a local turn, the PE on a remote one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.policy.auto import Source, enumerate_plans
from services.router.auto_pd import remote_history, tier_plan
from services.router.pd_tasks import pooled_blocks
from shared.protocol.tasks import KvPlan
from tests.unit.router.test_auto_dispatch import PD, dispatch, plan


@pytest.mark.parametrize("decode_engines", ["session", "dualpath"])
def test_the_pool_is_offered_on_pd_engines_when_the_index_places_the_prefix_there(
    decode_engines: str,
) -> None:
    d = dispatch(PD, decode_engines)
    snapshots = list(d.engines.engine_snapshots(64, ("prefill", "decode")))
    pooled = {"store": 32, "cxl:pool-0": 32}
    labels = {
        p.label
        for p in enumerate_plans(
            d._request(snapshots, plan("p"), pooled), d._snapshot(snapshots, pooled), d.profiles()
        )
    }
    assert "remote/pool" in labels
    assert ("local/pool" in labels) == (decode_engines == "session")  # dualpath decode engines only decode
    unpooled = {"store": 32}
    snapshot = d._snapshot(snapshots, unpooled)
    labels = {
        p.label for p in enumerate_plans(d._request(snapshots, plan("q"), unpooled), snapshot, d.profiles())
    }
    assert snapshot.pool_queue_tokens is None and not {"remote/pool", "local/pool"} & labels


def test_pooled_blocks_are_the_longest_pool_prefix_never_more_than_a_prefill_may_skip() -> None:
    p = plan("p")  # 32 full blocks and 10 tokens: all 32 may be skipped
    assert pooled_blocks(p, {"store": 30, "cxl:a": 4, "cxl:b": 9}, 64) == 9
    assert pooled_blocks(p, {"store": 30}, 64) == 0
    whole = replace(plan("w"), prompt_token_ids=[5] * 128)
    assert pooled_blocks(whole, {"cxl:a": 2}, 64) == 1  # a whole-block prompt computes its last block


def test_a_pool_plan_reads_the_pool_first_and_storage_below_it() -> None:
    hashes = KvPlan(block_hashes=list(range(8)), salt=77)
    local = tier_plan(hashes, Source.POOL, stored=3, pooled=5)
    assert (local.num_hit_blocks, local.read_side) == (5, "pool")
    below = tier_plan(hashes, Source.POOL, stored=6, pooled=2)  # storage holds more: it serves the rest
    assert (below.num_hit_blocks, below.read_side) == (6, "pool")
    stored = tier_plan(hashes, Source.STORAGE, stored=3, pooled=5)
    assert (stored.num_hit_blocks, stored.read_side) == (3, "")
    assert tier_plan(hashes, Source.RECOMPUTE, stored=3, pooled=5).num_hit_blocks == 0
    remote = remote_history(hashes, Source.POOL, 3, 7, kept_blocks=4, pooled=5)
    assert (remote.num_hit_blocks, remote.read_side) == (
        5,
        "pool",
    )  # the PE reads the pool, whatever was kept
    gone = remote_history(hashes, Source.POOL, 3, 7, kept_blocks=0, pooled=0)  # the pool lost it: storage
    assert (gone.num_hit_blocks, gone.read_side) == (3, "pe")
    # every plan keeps the request's chain salt (a tenant's or cache_salt's): the engines check the chain
    assert {p.salt for p in (local, below, stored, remote, gone)} == {77}


def test_the_pool_read_side_is_in_the_protocol_and_others_are_refused() -> None:
    KvPlan(block_hashes=[1, 2], num_hit_blocks=2, read_side="pool").check()
    with pytest.raises(ValueError, match="read_side"):
        KvPlan(block_hashes=[1], read_side="cxl").check()

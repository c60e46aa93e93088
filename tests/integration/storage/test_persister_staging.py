"""The engine's block persister (services/engine/persist.py) against a real storage service, with a staging
segment smaller than one step's full blocks: what fits is written, the rest follows at later steps as the
writes free space, every block lands in the store under its chained hash, and blocks still unstaged when
the request finishes are held in the cache until written (or let go, and counted, past PERSIST_WAIT_S).
Before, one step with more full blocks than the segment held (SmolLM2 in fp32 at 2,048 tokens a step)
wrote nothing for the whole request, so every later turn recomputed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from gpu.kv_cache import PagedKVCache
from services.engine import persist
from services.engine.node_storage import MIN_STAGING_BYTES, staging_bytes_for
from services.engine.persist import BlockPersister, PersistChain
from services.engine.sequence import Sequence
from shared.blocks import BlockLayout
from shared.kvclient import IndexClient, StorageClient
from shared.protocol import RequestPlan, SamplingParams
from tests.integration.storage.storage_harness import FP, LAYOUT, StorageCluster

NUM_BLOCKS = 8
STAGED_BLOCKS = 3  # what the staging segment holds


def _lost_to_staging() -> float:
    value = REGISTRY.get_sample_value("kvpath_engine_kv_persist_failures_total", {"reason": "staging_full"})
    return value or 0.0


async def _persister(cluster: StorageCluster) -> tuple[BlockPersister, PagedKVCache, Sequence]:
    await cluster.start()
    bus = await cluster.bus("engine")
    client = StorageClient(bus, 0, LAYOUT, FP, staging_bytes=LAYOUT.blocks_bytes(STAGED_BLOCKS))
    await client.start()
    cluster.clients.append(client)
    kv = PagedKVCache(
        num_blocks=NUM_BLOCKS, num_layers=LAYOUT.num_layers, block_size=LAYOUT.block_size,
        kv_dim=LAYOUT.bytes_per_token_layer // 4, dtype="float32", device="cpu",
    )  # fmt: skip
    kv.tensor.copy_(torch.randn(kv.tensor.shape))
    plan = RequestPlan(
        request_id="r1",
        router_id="router",
        prompt_token_ids=list(range(100, 100 + NUM_BLOCKS * LAYOUT.block_size)),
        sampling=SamplingParams(max_tokens=1),
        deadline_unix_s=1e12,
    )
    seq = Sequence(plan=plan, arrived_at=0.0, block_ids=kv.allocate(NUM_BLOCKS))
    seq.num_computed_tokens = NUM_BLOCKS * LAYOUT.block_size  # one step filled every block
    return BlockPersister(client, IndexClient(bus), kv, LAYOUT.block_size), kv, seq


async def test_blocks_beyond_the_staging_segment_follow_at_later_steps(cluster: StorageCluster) -> None:
    persister, kv, seq = await _persister(cluster)
    chain = PersistChain(0)
    persister.persist(seq, chain)
    assert (chain.num_persisted_blocks, chain.num_unstaged_blocks, len(chain.writes)) == (3, 5, 1)
    persister.persist(seq, chain)  # the next step: the first write still holds the whole segment
    assert (chain.num_persisted_blocks, chain.num_unstaged_blocks, len(chain.writes)) == (3, 5, 1)
    while chain.num_unstaged_blocks:
        await chain.writes[-1]  # frees its staging space
        persister.persist(seq, chain)
    assert chain.num_persisted_blocks == NUM_BLOCKS and len(chain.writes) == 3  # 3 + 3 + 2
    assert all(seq_no > 0 for seq_no in [await w for w in chain.writes])
    await _stored(persister, kv, seq, seq.block_ids)  # under the chained hashes a next turn asks
    await persister.close()


async def _stored(persister: BlockPersister, kv: PagedKVCache, seq: Sequence, blocks: list[int]) -> None:
    expected = np.empty((len(blocks), *LAYOUT.shape), dtype=np.uint8)
    kv.export_blocks(blocks, expected)
    lease = await persister.client.read("check", seq.block_hashes, deadline_s=5.0)
    async with lease:
        assert lease.num_blocks == len(blocks) and np.array_equal(lease.views, expected)


async def test_blocks_unstaged_when_the_request_ends_are_held_until_written(cluster: StorageCluster) -> None:
    """A short answer can end before its first write frees the segment: the rest is held in the cache (one
    more owner each, so the engine's free does not recycle them) and written as the space frees."""
    persister, kv, seq = await _persister(cluster)
    chain = PersistChain(0)
    persister.persist(seq, chain)  # 3 staged, 5 not; then the request ends
    snapshot = np.empty((NUM_BLOCKS, *LAYOUT.shape), dtype=np.uint8)
    kv.export_blocks(seq.block_ids, snapshot)
    before = _lost_to_staging()
    wait = persister.finish(seq, chain)
    blocks, seq.block_ids = seq.block_ids, []
    kv.free(blocks)  # the engine frees the finished sequence's blocks
    assert kv.num_free_blocks == STAGED_BLOCKS  # the 5 unstaged ones are still held
    assert wait is not None
    await wait
    assert kv.num_free_blocks == NUM_BLOCKS and _lost_to_staging() == before  # written, then let go
    lease = await persister.client.read("check", seq.block_hashes, deadline_s=5.0)
    async with lease:
        assert lease.num_blocks == NUM_BLOCKS and np.array_equal(lease.views, snapshot)
    await persister.close()


async def test_held_blocks_are_let_go_and_counted_when_the_segment_stays_full(
    cluster: StorageCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(persist, "PERSIST_WAIT_S", 0.3)
    persister, kv, seq = await _persister(cluster)
    occupied = persister.client.stage(STAGED_BLOCKS)  # staged and never written: the segment stays full
    chain = PersistChain(0)
    persister.persist(seq, chain)
    assert chain.num_unstaged_blocks == NUM_BLOCKS and not chain.writes
    before = _lost_to_staging()
    wait = persister.finish(seq, chain)
    kv.free(seq.block_ids)
    assert kv.num_free_blocks == 0 and wait is not None
    assert await chain.writes[-1] == 0  # the held blocks' work: nothing written
    assert _lost_to_staging() - before == NUM_BLOCKS and kv.num_free_blocks == NUM_BLOCKS
    await wait
    persister.client.unstage(occupied)
    await persister.close()


async def test_a_session_engine_drops_and_counts_the_unstaged_blocks_instead(cluster: StorageCluster) -> None:
    """Its allocator counts resident blocks as free (evicted on demand), which a held block would not be;
    the session keeps its KV on the engine anyway."""
    persister, kv, seq = await _persister(cluster)
    persister.holds_unstaged = False
    chain = PersistChain(0)
    persister.persist(seq, chain)
    before = _lost_to_staging()
    wait = persister.finish(seq, chain)
    kv.free(seq.block_ids)
    assert _lost_to_staging() - before == NUM_BLOCKS - STAGED_BLOCKS and kv.num_free_blocks == NUM_BLOCKS
    assert wait is not None
    await wait  # the staged three are still written
    assert len(chain.writes) == 1 and chain.writes[0].result() > 0
    await persister.close()


@pytest.mark.parametrize(
    ("layout", "step_blocks"),
    [
        (BlockLayout(num_layers=30, block_size=64, bytes_per_token_layer=1536), 33),  # SmolLM2, fp32
        (BlockLayout(num_layers=4, block_size=64, bytes_per_token_layer=512), 0),  # tiny: the floor
    ],
)
def test_the_default_staging_holds_two_steps_of_full_blocks(layout: BlockLayout, step_blocks: int) -> None:
    staging = staging_bytes_for(layout, step_tokens=2048)
    assert staging >= 2 * layout.blocks_bytes(33) and staging >= MIN_STAGING_BYTES
    assert staging == max(MIN_STAGING_BYTES, 2 * layout.blocks_bytes(step_blocks))

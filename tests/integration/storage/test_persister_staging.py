"""The engine's block persister (services/engine/persist.py) against a real storage service, with a staging
segment smaller than one step's full blocks: what fits is written, the rest follows at later steps as the
writes free space, every block lands in the store under its chained hash, and blocks still unstaged when the
request finishes are counted. Before, one step with more full blocks than the segment held (SmolLM2 in fp32
at 2,048 tokens a step) wrote nothing for the whole request, so every later turn recomputed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from gpu.kv_cache import PagedKVCache
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
    written = [await w for w in chain.writes]
    assert all(seq_no > 0 for seq_no in written)
    expected = np.empty((NUM_BLOCKS, *LAYOUT.shape), dtype=np.uint8)
    kv.export_blocks(seq.block_ids, expected)
    lease = await persister.client.read("check", seq.block_hashes, deadline_s=5.0)
    async with lease:
        assert lease.num_blocks == NUM_BLOCKS  # every block, under the chained hashes a next turn asks
        assert np.array_equal(lease.views, expected)
    await persister.close()


async def test_blocks_still_unstaged_when_the_request_finishes_are_counted(cluster: StorageCluster) -> None:
    persister, _kv, seq = await _persister(cluster)
    chain = PersistChain(0)
    before = _lost_to_staging()
    persister.persist(seq, chain)
    persister.persist(seq, chain)  # no room yet; then the request ends
    wait = persister.finish(seq.request_id, chain)
    assert _lost_to_staging() - before == NUM_BLOCKS - STAGED_BLOCKS and chain.num_unstaged_blocks == 0
    assert wait is not None
    await wait  # the staged blocks still become durable
    assert chain.writes[0].result() > 0
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

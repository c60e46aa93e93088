"""The storage service for real: files under a root, the node buffer in shared memory, KV events."""

from __future__ import annotations

import numpy as np
import pytest

from services.storage import metrics
from services.storage.block_store import HEADER_BYTES
from shared.blocks import is_view_of
from shared.errors import InvalidRequestError
from shared.hashing import fingerprint_seed, model_fingerprint
from shared.protocol import ErrorReply, decode
from shared.protocol.kv import BlockRemoved, BlockStored, StorageReadRequest, StorageWriteRequest
from tests.integration.storage.storage_harness import (
    FP,
    LAYOUT,
    StorageCluster,
    chain,
    stream_events,
    wait_for,
    write_blocks,
)


async def test_write_then_read_in_place(cluster: StorageCluster) -> None:
    node = await cluster.start()
    hashes, parents = chain(6)
    data = await write_blocks(node.client, hashes, parents)
    again = await node.client.write(node.client.stage(6), hashes, parents)
    assert (again.num_written, again.num_existing) == (0, 6)
    lease = await node.client.read("req-1", hashes, deadline_s=5.0)
    assert lease.num_blocks == 6 and lease.miss_reason == ""
    assert lease.views.shape == (6, *LAYOUT.shape) and np.array_equal(lease.views, data)
    assert np.array_equal(lease.layer(1), data[:, 1])
    # the views point into the node buffer the service owns: no copy on the way to the engine
    assert node.client._buffer is not None and is_view_of(lease.views, node.client._buffer.array())
    assert node.service.reader.space.used_bytes >= 6 * LAYOUT.full_block_bytes
    await lease.release()
    assert node.service.reader.space.used_bytes == 0 and len(node.service.reader.space.leases) == 0
    await lease.release()  # idempotent
    stored = [e for e in await stream_events(node.client.bus) if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [hashes, hashes]
    assert (
        stored[0].parent_hashes == parents and stored[0].location == "store" and stored[0].block_tokens == 16
    )
    assert [e.seq for e in stored] == [1, 2] and stored[0].source == "storage-0"


async def test_partial_prefix_when_a_block_is_missing(cluster: StorageCluster) -> None:
    node = await cluster.start()
    hashes, parents = chain(5)
    data = await write_blocks(node.client, hashes[:3], parents[:3])
    lease = await node.client.read("req-2", hashes, deadline_s=5.0)
    assert lease.num_blocks == 3 and lease.miss_reason == "missing"
    assert np.array_equal(lease.views, data)
    await lease.release()
    empty = await node.client.read("req-3", hashes[3:], deadline_s=5.0)
    assert empty.num_blocks == 0 and empty.lease_id == "" and empty.views.shape[0] == 0
    await wait_for(lambda: node.service.reader.space.used_bytes == 0, 2.0, "buffer freed")


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
async def test_bad_block_file_is_a_miss_removed_and_announced(cluster: StorageCluster, damage: str) -> None:
    node = await cluster.start()
    hashes, parents = chain(4)
    data = await write_blocks(node.client, hashes, parents)
    path = node.service.store.path_for(fingerprint_seed(FP), hashes[2])
    raw = bytearray(path.read_bytes())
    if damage == "corrupt":
        raw[HEADER_BYTES + 1000] ^= 0xFF
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    else:  # a valid file of another model (its header names another fingerprint) at this model's path
        node.service.store.write(fingerprint_seed(FP) ^ 1, hashes[2], parents[2], memoryview(bytes(data[2])))
        raw = bytearray(node.service.store.path_for(fingerprint_seed(FP) ^ 1, hashes[2]).read_bytes())
    path.write_bytes(bytes(raw))
    before = metrics.BAD_BLOCKS.labels("foreign" if damage == "foreign" else "corrupt")._value.get()
    lease = await node.client.read("req-bad", hashes, deadline_s=5.0)
    assert lease.num_blocks == 2 and lease.miss_reason == ("foreign" if damage == "foreign" else "corrupt")
    assert np.array_equal(lease.views, data[:2])
    await lease.release()
    assert not path.exists()
    reason = "foreign" if damage == "foreign" else "corrupt"
    assert metrics.BAD_BLOCKS.labels(reason)._value.get() == before + 1

    async def announced() -> bool:
        events = await stream_events(node.client.bus)
        return any(isinstance(e, BlockRemoved) and e.block_hashes == [hashes[2]] for e in events)

    await wait_for(announced, 5.0, "BlockRemoved for the bad block")
    removed = [e for e in await stream_events(node.client.bus) if isinstance(e, BlockRemoved)]
    assert removed[0].reason == reason and removed[0].location == "store"
    # the service keeps serving; the block can be written again and read back
    await write_blocks(node.client, hashes[2:3], parents[2:3], seed=5)
    lease = await node.client.read("req-again", hashes, deadline_s=5.0)
    assert lease.num_blocks == 4
    await lease.release()


async def test_two_fingerprints_never_hit_each_others_blocks(cluster: StorageCluster) -> None:
    other_fp = model_fingerprint(
        "other", dtype="uint8", block_size=16, num_layers=2, bytes_per_token_layer=512
    )
    node = await cluster.start()
    other = await cluster.client(0, fp=other_fp)
    hashes, parents = chain(3)
    await write_blocks(node.client, hashes, parents)
    # the same hashes asked for under another model: a miss (files live under the fingerprint's hash)
    lease = await other.read("req-other", hashes, deadline_s=5.0)
    assert lease.num_blocks == 0 and lease.miss_reason == "missing"
    # and the salted chain of the same tokens differs anyway
    assert set(chain(3, fp=other_fp)[0]).isdisjoint(hashes)
    # the first model still hits
    lease = await node.client.read("req-mine", hashes, deadline_s=5.0)
    assert lease.num_blocks == 3
    await lease.release()


async def test_malformed_and_invalid_requests_get_errors(cluster: StorageCluster) -> None:
    node = await cluster.start()
    bus, subjects = node.client.bus, node.client.bus.subjects
    raw = await bus.nc.request(subjects.storage_read(0), b"{not json", timeout=2)
    assert decode(raw.data, ErrorReply).code == "bad_message"
    raw = await bus.nc.request(subjects.storage_write(0), b'{"kind": "storage_write", "v": 1}', timeout=2)
    assert decode(raw.data, ErrorReply).code == "bad_message"
    bad_read = StorageReadRequest(request_id="r", fingerprint=FP, block_hashes=[1], block_bytes=0)
    with pytest.raises(InvalidRequestError, match="block_bytes"):
        await bus.request(subjects.storage_read(0), bad_read, ErrorReply)
    negative = StorageReadRequest(request_id="r", fingerprint=FP, block_hashes=[-1], block_bytes=10)
    with pytest.raises(InvalidRequestError, match="64-bit"):
        await bus.request(subjects.storage_read(0), negative, ErrorReply)
    hashes, parents = chain(2)
    write = StorageWriteRequest(
        request_id="w",
        fingerprint=FP,
        segment_name="kvpath-no-such-segment",
        offsets=[0, LAYOUT.full_block_bytes],
        block_bytes=LAYOUT.full_block_bytes,
        block_hashes=hashes,
        parent_hashes=parents,
    )
    with pytest.raises(InvalidRequestError, match="not found"):
        await bus.request(subjects.storage_write(0), write, ErrorReply)
    assert node.client._staging is not None
    write.segment_name = node.client._staging.name
    write.offsets = [0, 8 << 20]
    with pytest.raises(InvalidRequestError, match="outside segment"):
        await bus.request(subjects.storage_write(0), write, ErrorReply)
    write.offsets = [0]
    with pytest.raises(InvalidRequestError, match="offsets"):
        await bus.request(subjects.storage_write(0), write, ErrorReply)
    # still serving
    await write_blocks(node.client, hashes, parents)
    assert (await node.client.read("ok", hashes, deadline_s=5.0)).num_blocks == 2


async def test_nodes_sharing_a_root_read_each_others_blocks(cluster: StorageCluster) -> None:
    node0 = await cluster.start(0, is_shared_root=True)
    node1 = await cluster.start(1, is_shared_root=True)
    assert node0.service.buffer_name != node1.service.buffer_name
    hashes, parents = chain(4)
    data = await write_blocks(node0.client, hashes, parents)
    lease = await node1.client.read("req-x", hashes, deadline_s=5.0)
    assert lease.num_blocks == 4 and np.array_equal(lease.views, data)
    assert node1.service.reader.space.used_bytes > 0 and node0.service.reader.space.used_bytes == 0
    await lease.release()
    # node 1 writing the same blocks finds them stored and does not account for node 0's files
    result = await node1.client.write(node1.client.stage(4), hashes, parents)
    assert result.num_existing == 4 and len(node1.service.catalog) == 0 and len(node0.service.catalog) == 4

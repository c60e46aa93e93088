"""Paged KV cache: allocation, Full Block / Layer Block export and import (byte-exact, zero-copy views)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.kv_cache import PagedKVCache
from shared.errors import OverloadedError


def make_cache(dtype: str = "float32", num_blocks: int = 12) -> PagedKVCache:
    return PagedKVCache(
        num_blocks=num_blocks, num_layers=3, block_size=4, kv_dim=10, dtype=dtype, device="cpu"
    )


def random_blocks(cache: PagedKVCache, n: int, seed: int) -> np.ndarray:
    shape = (n, cache.num_layers, cache.block_size, cache.bytes_per_token_layer)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def test_geometry() -> None:
    cache = make_cache("bfloat16")
    assert cache.bytes_per_token_layer == 20
    assert cache.layer_block_bytes == 80
    assert cache.full_block_bytes == 240
    assert cache.tensor.shape == (12, 3, 4, 10) and cache.tensor.dtype == torch.bfloat16
    assert cache.tensor[5].untyped_storage().nbytes() == 12 * 240  # one tensor: a Full Block is a slice of it
    assert cache.tensor[5].is_contiguous() and cache.tensor[5, 1].is_contiguous()


def test_allocate_and_free() -> None:
    cache = make_cache(num_blocks=5)
    first = cache.allocate(3)
    assert first == [0, 1, 2] and cache.num_free_blocks == 2
    assert cache.can_allocate(2) and not cache.can_allocate(3)
    with pytest.raises(OverloadedError):
        cache.allocate(3)
    cache.free([1])
    with pytest.raises(ValueError, match="double free"):
        cache.free([1])
    with pytest.raises(ValueError, match="double free"):
        cache.free([0, 0])
    with pytest.raises(ValueError, match="out of range"):
        cache.free([7])
    assert sorted(cache.allocate(3)) == [1, 3, 4]
    assert cache.num_free_blocks == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_export_import_round_trip_is_byte_exact(dtype: str) -> None:
    cache = make_cache(dtype)
    source_ids = [3, 7, 8, 9, 0]  # runs and gaps
    data = random_blocks(cache, len(source_ids), seed=1)  # includes NaN bit patterns: bytes must survive
    cache.import_blocks(source_ids, data)
    out = np.empty_like(data)
    cache.export_blocks(source_ids, out)
    assert out.tobytes() == data.tobytes()
    # into other blocks and back: still identical bytes
    target_ids = [11, 1, 2]
    cache.import_blocks(target_ids, out[:3])
    again = np.empty_like(out[:3])
    cache.export_blocks(target_ids, again)
    assert again.tobytes() == data[:3].tobytes()
    assert cache.tensor[7].contiguous().view(torch.uint8).numpy().tobytes() == data[1].tobytes()


@pytest.mark.parametrize(
    "block_ids",
    [
        [4, 5, 6, 7],  # one run: one slice copy
        [9, 2, 3, 11],  # a few runs: a slice copy each
        [11, 9, 7, 5, 3, 1, 0, 2, 4, 6, 8, 10],  # scattered past MAX_RUN_COPIES: one index_copy_/select
        [3, 4, 0],  # a run, then a step back
    ],
)
def test_copies_by_runs_and_by_index_agree(block_ids: list[int]) -> None:
    assert len(block_ids) <= 12
    cache = make_cache(num_blocks=12)
    data = random_blocks(cache, len(block_ids), seed=7)
    cache.import_blocks(block_ids, data)
    for i, b in enumerate(block_ids):  # each block landed where its id says, nothing else moved
        assert cache.tensor[b].contiguous().view(torch.uint8).numpy().tobytes() == data[i].tobytes()
    untouched = sorted(set(range(12)) - set(block_ids))
    assert not cache.tensor[untouched].any()
    layer = np.empty_like(data[:, 1])
    cache.export_layer(block_ids, 1, layer)
    assert layer.tobytes() == data[:, 1].tobytes()
    layer2 = random_blocks(cache, len(block_ids), seed=8)[:, 2]
    cache.import_layer(block_ids, 2, layer2)
    out = np.empty_like(data)
    cache.export_blocks(block_ids, out)
    assert out[:, 2].tobytes() == layer2.tobytes() and out[:, 0].tobytes() == data[:, 0].tobytes()


def test_layer_blocks_are_slices_of_full_blocks() -> None:
    cache = make_cache()
    ids = [4, 2, 10]
    data = random_blocks(cache, 3, seed=2)
    cache.import_blocks(ids, data)
    staging = np.zeros_like(data)  # a node buffer of Full Blocks; export layer by layer into strided views
    for layer in range(cache.num_layers):
        view = staging[:, layer]
        assert not view.flags.c_contiguous and view[0].flags.c_contiguous
        cache.export_layer(ids, layer, view)
    assert staging.tobytes() == data.tobytes()
    other = make_cache()
    for layer in range(other.num_layers):  # rebuild on the receiving side one Layer Block set at a time
        other.import_layer([0, 1, 2], layer, staging[:, layer])
    full = np.empty_like(data)
    other.export_blocks([0, 1, 2], full)
    assert full.tobytes() == data.tobytes()


def test_export_writes_into_the_callers_buffer() -> None:
    cache = make_cache()
    data = random_blocks(cache, 2, seed=3)
    cache.import_blocks([5, 6], data)
    backing = bytearray(data.nbytes + 16)
    out = np.frombuffer(backing, dtype=np.uint8, offset=16, count=data.nbytes).reshape(data.shape)
    cache.export_blocks([5, 6], out)  # e.g. a view into a shared-memory segment
    assert bytes(backing[16:]) == data.tobytes()


def test_read_only_source_and_bad_shapes() -> None:
    cache = make_cache()
    data = random_blocks(cache, 2, seed=4)
    read_only = np.frombuffer(data.tobytes(), dtype=np.uint8).reshape(data.shape)
    assert not read_only.flags.writeable
    cache.import_blocks([0, 1], read_only)  # no warning (warnings are errors here), no copy needed
    with pytest.raises(ValueError, match="uint8"):
        cache.export_blocks([0, 1], np.empty((2, 3, 4, 40), dtype=np.float32))
    with pytest.raises(ValueError, match="uint8"):
        cache.export_blocks([0], np.empty_like(data))
    with pytest.raises(ValueError, match="contiguous"):
        cache.export_layer([0, 1], 0, np.empty((2, 4, 40), dtype=np.uint8)[:, ::-1])

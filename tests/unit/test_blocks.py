"""Block layout: Full Block = Layer Blocks layer-major, zero-copy views, the extent allocator."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from shared.blocks import BlockLayout, ExtentAllocator, full_blocks_view, is_view_of, layer_view

LAYOUT = BlockLayout(num_layers=3, block_size=4, bytes_per_token_layer=16)


def test_sizes_and_offsets() -> None:
    assert LAYOUT.layer_block_bytes == 64
    assert LAYOUT.full_block_bytes == 192
    assert [LAYOUT.layer_offset(layer) for layer in range(3)] == [0, 64, 128]
    assert LAYOUT.shape == (3, 4, 16)
    with pytest.raises(IndexError):
        LAYOUT.layer_offset(3)
    with pytest.raises(ValueError):
        BlockLayout(0, 4, 16)


def test_full_block_is_its_layer_blocks_concatenated() -> None:
    rng = np.random.default_rng(1)
    layer_blocks = [rng.integers(0, 256, size=(1, 4, 16), dtype=np.uint8) for _ in range(3)]
    full = np.concatenate(layer_blocks, axis=0)
    buf = bytearray(full.tobytes())
    view = full_blocks_view(buf, 0, 1, LAYOUT)
    for layer in range(3):
        start = LAYOUT.layer_offset(layer)
        assert bytes(buf[start : start + LAYOUT.layer_block_bytes]) == layer_blocks[layer].tobytes()
        assert np.array_equal(view[0, layer], layer_blocks[layer][0])


@pytest.mark.parametrize("kind", ["bytearray", "mmap", "ndarray", "memoryview"])
def test_views_are_views_not_copies(kind: str) -> None:
    size = 4096
    backing: bytearray | mmap.mmap | np.ndarray | memoryview
    if kind == "bytearray":
        backing = bytearray(size)
    elif kind == "mmap":
        backing = mmap.mmap(-1, size)
    elif kind == "ndarray":
        backing = np.zeros(size, dtype=np.uint8)
    else:
        backing = memoryview(bytearray(size))
    view = LAYOUT.full_blocks_view(backing, 384, 2)
    assert view.shape == (2, 3, 4, 16) and view.dtype == np.uint8
    assert is_view_of(view, backing)
    view[1, 2, 3, 15] = 7  # the last byte of the second block
    flat = np.frombuffer(backing, dtype=np.uint8) if kind != "ndarray" else backing
    assert flat[384 + 2 * 192 - 1] == 7
    layer = layer_view(view, 1)
    assert layer.shape == (2, 4, 16) and is_view_of(layer, backing)
    assert not layer.flags.c_contiguous and layer[0].flags.c_contiguous  # strided; Layer Blocks contiguous
    layer[0] = 9
    assert (flat[384 + 64 : 384 + 128] == 9).all() and flat[384 + 63] == 0 and flat[384 + 128] == 0


def test_view_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="exceed"):
        LAYOUT.full_blocks_view(bytearray(1000), 900, 1)
    with pytest.raises(ValueError, match="contiguous"):
        full_blocks_view(np.zeros((10, 100), np.uint8)[:, ::2], 0, 1, LAYOUT)
    with pytest.raises(IndexError):
        layer_view(LAYOUT.empty_blocks(1), 3)


def test_extent_allocator_first_fit_coalesce_shrink() -> None:
    alloc = ExtentAllocator(10 * 4096 + 100)
    assert alloc.free_bytes == 10 * 4096  # the unaligned tail is unusable
    a = alloc.allocate(1)
    b = alloc.allocate(4097)
    c = alloc.allocate(3 * 4096)
    assert (a, b, c) == (0, 4096, 3 * 4096)
    assert alloc.size_of(b) == 2 * 4096
    assert alloc.allocate(5 * 4096) is None  # only 4 pages left at the end
    alloc.free(b)
    assert alloc.allocate(2 * 4096) == 4096  # first fit reuses the hole
    alloc.free(a)
    alloc.free(4096)
    assert alloc.largest_free_bytes == 4 * 4096  # coalesced with neighbours: [0, 3) and [6, 10)
    alloc.shrink(c, 4096)
    assert alloc.size_of(c) == 4096 and alloc.largest_free_bytes == 6 * 4096
    alloc.free(c)
    assert alloc.free_bytes == 10 * 4096 and alloc.largest_free_bytes == 10 * 4096 and alloc.num_extents == 0
    with pytest.raises(KeyError):
        alloc.free(c)
    with pytest.raises(ValueError):
        alloc.allocate(0)

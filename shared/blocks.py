"""Full Block / Layer Block layout, zero-copy numpy views, and a contiguous-extent allocator for KV buffers.

A Full Block is `[num_layers, block_size, bytes_per_token_layer]` bytes, its Layer Blocks concatenated
layer-major, so layer l of a block is one contiguous `[block_size, bytes]` region at `layer_offset(l)`.
Storage files, the node DRAM buffer, engine staging segments and transports all hold blocks in this
layout, so no layout conversion ever happens. Views here are numpy uint8; gpu/ wraps them with
`torch.from_numpy` (the only package that imports torch).
"""

from __future__ import annotations

import bisect
import mmap
from dataclasses import dataclass, field

import numpy as np

Buffer = memoryview | mmap.mmap | bytearray | np.ndarray


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partial)."""
    return -(-num_tokens // block_size)


CONTEXT_BUFFER_FLOOR = 256 * 1024 * 1024
CONTEXT_BUFFER_CEILING = 4 * 1024 * 1024 * 1024  # a long-context model's default (set more explicitly)
CONTEXT_BUFFER_CONTEXTS = 2  # sequences of the model's full length a default buffer holds


def context_buffer_bytes(context_bytes: int) -> int:
    """The default size of a buffer that holds whole sequences' KV (an engine's paged cache, a DE buffer, a
    PE's staging or receive area, a node buffer per engine): CONTEXT_BUFFER_CONTEXTS sequences of
    `context_bytes` (one of the model's full length), between CONTEXT_BUFFER_FLOOR and
    CONTEXT_BUFFER_CEILING. A fixed 256 MiB held 5,800 tokens of SmolLM2's fp32 KV, under its 8,192-token
    context."""
    return min(CONTEXT_BUFFER_CEILING, max(CONTEXT_BUFFER_FLOOR, CONTEXT_BUFFER_CONTEXTS * context_bytes))


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The most leading full blocks of a prompt whose KV may be loaded instead of computed: the block holding
    the last prompt token is always computed, because that token's logits sample the first output token.
    The router caps index hits with it, engines check plans against it, the simulator caps its hits."""
    return max(0, (num_prompt_tokens - 1) // block_size)


@dataclass(slots=True, frozen=True)
class BlockLayout:
    """Geometry of one model's KV blocks (all sizes in bytes unless the name says otherwise)."""

    num_layers: int
    block_size: int  # tokens per block
    bytes_per_token_layer: int  # K and V of one token in one layer, all KV heads

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "bytes_per_token_layer"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BlockLayout.{name} must be > 0, got {getattr(self, name)}")

    @property
    def layer_block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token_layer

    @property
    def full_block_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes

    @property
    def shape(self) -> tuple[int, int, int]:
        """Shape of one Full Block as a uint8 array."""
        return (self.num_layers, self.block_size, self.bytes_per_token_layer)

    def layer_offset(self, layer: int) -> int:
        """Byte offset of layer `layer`'s Layer Block inside a Full Block."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return layer * self.layer_block_bytes

    def blocks_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.full_block_bytes

    def full_blocks_view(self, buf: Buffer, offset: int, num_blocks: int) -> np.ndarray:
        """Zero-copy uint8 view `[num_blocks, num_layers, block_size, bytes]` of `buf` at byte `offset`."""
        return full_blocks_view(buf, offset, num_blocks, self)

    def empty_blocks(self, num_blocks: int) -> np.ndarray:
        """A fresh (heap) array of `num_blocks` Full Blocks, for tests and tools."""
        return np.zeros((num_blocks, *self.shape), dtype=np.uint8)


def _flat_bytes(buf: Buffer) -> np.ndarray:
    """`buf` as a flat uint8 array sharing its memory (raises rather than copy)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer array must be C-contiguous to take block views of it")
        flat = buf.reshape(-1).view(np.uint8)
        if not np.shares_memory(flat, buf):  # pragma: no cover - reshape of a contiguous array is a view
            raise AssertionError("flattening copied the buffer")
        return flat
    return np.frombuffer(buf, dtype=np.uint8)


def full_blocks_view(buf: Buffer, offset: int, num_blocks: int, layout: BlockLayout) -> np.ndarray:
    """Zero-copy view of `num_blocks` consecutive Full Blocks in `buf` starting at byte `offset`.

    `buf` may be a memoryview, mmap, bytearray or a contiguous ndarray (e.g. a `ShmSegment.array()`);
    writes through the view land in `buf`.
    """
    flat = _flat_bytes(buf)
    nbytes = num_blocks * layout.full_block_bytes
    if offset < 0 or num_blocks < 0 or offset + nbytes > flat.size:
        raise ValueError(
            f"{num_blocks} blocks of {layout.full_block_bytes} B at offset {offset} exceed the "
            f"{flat.size} B buffer"
        )
    return flat[offset : offset + nbytes].reshape(num_blocks, *layout.shape)


def layer_view(full_blocks: np.ndarray, layer: int) -> np.ndarray:
    """Layer `layer` of every block: a strided view `[n, block_size, bytes]`, each slice contiguous."""
    if full_blocks.ndim != 4:
        raise ValueError(f"expected [n, layers, block_size, bytes], got shape {full_blocks.shape}")
    if not 0 <= layer < full_blocks.shape[1]:
        raise IndexError(f"layer {layer} out of range [0, {full_blocks.shape[1]})")
    return full_blocks[:, layer]


def is_view_of(view: np.ndarray, buf: Buffer) -> bool:
    """True when `view` shares memory with `buf` (a view, not a copy)."""
    return bool(np.shares_memory(view, _flat_bytes(buf)))


# ------------------------------------------------------------------------------------------ allocator


@dataclass(slots=True)
class ExtentAllocator:
    """First-fit allocator of contiguous byte extents in a buffer of `capacity_bytes`.

    Pure bookkeeping (no memory is touched): free extents are kept sorted by offset and coalesced on free.
    Extents are `alignment`-aligned so views start on page boundaries. Used for the storage service's node
    buffer and for engines' staging segments; n blocks of one request get one extent, so they form a single
    `[n, L, bs, bytes]` view.
    """

    capacity_bytes: int
    alignment: int = 4096
    _free_offsets: list[int] = field(default_factory=list)
    _free_sizes: list[int] = field(default_factory=list)
    _used: dict[int, int] = field(default_factory=dict)  # offset -> size

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.alignment <= 0:
            raise ValueError(f"invalid allocator capacity={self.capacity_bytes} alignment={self.alignment}")
        usable = self.capacity_bytes - self.capacity_bytes % self.alignment
        self._free_offsets, self._free_sizes = ([0], [usable]) if usable else ([], [])

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return sum(self._free_sizes)

    @property
    def largest_free_bytes(self) -> int:
        return max(self._free_sizes, default=0)

    @property
    def num_extents(self) -> int:
        return len(self._used)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes`, or None when no free extent is large enough."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be > 0, got {nbytes}")
        size = self._round(nbytes)
        for i, free in enumerate(self._free_sizes):
            if free >= size:
                offset = self._free_offsets[i]
                if free == size:
                    del self._free_offsets[i], self._free_sizes[i]
                else:
                    self._free_offsets[i] += size
                    self._free_sizes[i] -= size
                self._used[offset] = size
                return offset
        return None

    def shrink(self, offset: int, nbytes: int) -> None:
        """Give back the tail of an extent beyond `nbytes` (0 frees it)."""
        size = self._used.get(offset)
        if size is None:
            raise KeyError(f"no extent at offset {offset}")
        keep = self._round(nbytes) if nbytes > 0 else 0
        if keep >= size:
            return
        if keep == 0:
            del self._used[offset]
        else:
            self._used[offset] = keep
        self._insert_free(offset + keep, size - keep)

    def free(self, offset: int) -> None:
        self.shrink(offset, 0)

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def _insert_free(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        self._free_offsets.insert(i, offset)
        self._free_sizes.insert(i, size)
        # coalesce with the right neighbour, then the left one
        if i + 1 < len(self._free_offsets) and offset + size == self._free_offsets[i + 1]:
            self._free_sizes[i] += self._free_sizes.pop(i + 1)
            self._free_offsets.pop(i + 1)
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
            self._free_sizes[i - 1] += self._free_sizes.pop(i)
            self._free_offsets.pop(i)

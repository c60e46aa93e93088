"""Paged KV cache: one tensor [num_blocks, num_layers, block_size, kv_dim] plus a free list.

A Full Block (all layers of one block) and a Layer Block ([block_size, kv_dim] of one layer) are both
contiguous, so export/import to storage buffers and the network never converts layouts: the byte image of
block b is exactly `tensor[b]`. Copies go device <-> host in one call per run of consecutive block ids (one
call in all for the CPU's index kernels), never per element.

Ownership: the engine allocates a sequence's blocks, passes their ids in `PrefillSeq`/`DecodeSeq`, and frees
them; the runner only reads and writes the blocks it is handed. Blocks are reference-counted: `share` gives
one more owner (the n choices of a request share their prompt's blocks, nano-vllm's and vLLM's fork), `free`
drops one, and a block returns to the free list when its last owner frees it. A block with several owners is
read-only: an owner about to write into it copies it first (`copy_blocks`; the engine's scheduler decides).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from gpu.model_spec import dtype_bytes
from shared.errors import ConfigError, OverloadedError

# CPU copies: a slice copy per run of consecutive block ids (parallel, ~1.7x torch's index_copy_ into a layer
# of the cache, which is strided) unless the ids are this scattered, then one index_copy_/index_select
MAX_RUN_COPIES = 8
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagedKVCache:
    def __init__(
        self, *, num_blocks: int, num_layers: int, block_size: int, kv_dim: int, dtype: str, device: str
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ConfigError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.kv_dim = kv_dim
        self.dtype = dtype
        self.device = device
        self.bytes_per_token_layer = kv_dim * dtype_bytes(dtype)
        self.layer_block_bytes = block_size * self.bytes_per_token_layer
        self.full_block_bytes = num_layers * self.layer_block_bytes
        self.tensor = torch.zeros(
            (num_blocks, num_layers, block_size, kv_dim), dtype=TORCH_DTYPES[dtype], device=device
        )
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = np.zeros(num_blocks, dtype=np.int32)  # owners per block; 0: free
        self._null_block = -1  # see null_block

    @property
    def null_block(self) -> int:
        """The placeholder id of positions whose KV is not in this cache (a chunk held by another engine):
        taken from the pool on first use and never returned; `free` skips it, the runner never reads or
        writes it (gpu/partial_attention_routed.py)."""
        if self._null_block < 0:
            self._null_block = self.allocate(1)[0]
        return self._null_block

    @property
    def null_block_or_none(self) -> int:
        """`null_block` if it was taken, else -1 (no block table holds it yet); reading it takes nothing."""
        return self._null_block

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free_ids):
            raise OverloadedError(f"KV cache full: {n} blocks wanted, {len(self._free_ids)} free")
        block_ids = [self._free_ids.pop() for _ in range(n)]
        self._refs[block_ids] = 1
        return block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """One more owner of each (allocated) block; each owner frees it once."""
        ids = self._owned(block_ids)
        self._refs[ids] += 1

    def ref_count(self, block_id: int) -> int:
        """Owners of the block (0: free): more than one, and it must be copied before it is written."""
        return int(self._refs[block_id])

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one owner of each block; blocks left without one return to the free list."""
        ids = self._owned(block_ids)
        if ids.size == 0:
            return
        self._refs[ids] -= 1
        released = ids[self._refs[ids] == 0]
        self._free_ids.extend(sorted(released.tolist(), reverse=True))

    def _owned(self, block_ids: Sequence[int]) -> np.ndarray:
        """The ids as an array, without the null block; raise for ids out of range, free or repeated."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if self._null_block >= 0 and (ids == self._null_block).any():
            ids = ids[ids != self._null_block]
        if ids.size == 0:
            return ids
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            raise ValueError(f"block id out of range 0..{self.num_blocks - 1}: {list(block_ids)}")
        if (self._refs[ids] == 0).any() or np.unique(ids).size != ids.size:
            raise ValueError(f"double free of KV blocks {[int(b) for b in ids if self._refs[b] == 0]}")
        return ids

    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copy Full Blocks `src_ids` onto `dst_ids` in the cache (every layer; one gather, one scatter)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"copy of {len(src_ids)} blocks onto {len(dst_ids)}")
        if not src_ids:
            return
        device = self.tensor.device
        src = torch.as_tensor(list(src_ids), dtype=torch.long, device=device)
        dst = torch.as_tensor(list(dst_ids), dtype=torch.long, device=device)
        self.tensor.index_copy_(0, dst, self.tensor.index_select(0, src))

    # ----------------------------------------------------------------------------------- export / import

    def synchronize(self) -> None:
        """Wait for every copy queued on the cache's device (CUDA kernels and copies run asynchronously;
        on the CPU there is nothing to wait for). For timing, not for correctness: the model's own kernels
        run after the copies on the same stream."""
        if self.tensor.device.type == "cuda":
            torch.cuda.synchronize(self.tensor.device)

    def export_blocks(self, block_ids: Sequence[int], out: np.ndarray) -> None:
        """Copy Full Blocks into `out`: uint8 [n, num_layers, block_size, bytes_per_token_layer]."""
        shape = (len(block_ids), self.num_layers, self.block_size, self.bytes_per_token_layer)
        self._copy_out(self.tensor, block_ids, self._host_view(out, shape, "out"))

    def import_blocks(self, block_ids: Sequence[int], src: np.ndarray) -> None:
        """Inverse of export_blocks."""
        shape = (len(block_ids), self.num_layers, self.block_size, self.bytes_per_token_layer)
        self._copy_in(self.tensor, block_ids, self._host_view(src, shape, "src"))

    def export_layer(self, block_ids: Sequence[int], layer: int, out: np.ndarray) -> None:
        """Copy layer `layer` of the blocks into `out`: uint8 [n, block_size, bytes_per_token_layer]
        (may be a strided view, e.g. layer `layer` of Full Blocks in a staging buffer)."""
        shape = (len(block_ids), self.block_size, self.bytes_per_token_layer)
        self._copy_out(self.tensor[:, layer], block_ids, self._host_view(out, shape, "out"))

    def import_layer(self, block_ids: Sequence[int], layer: int, src: np.ndarray) -> None:
        shape = (len(block_ids), self.block_size, self.bytes_per_token_layer)
        self._copy_in(self.tensor[:, layer], block_ids, self._host_view(src, shape, "src"))

    def _host_view(self, array: np.ndarray, shape: tuple[int, ...], what: str) -> torch.Tensor:
        """A torch view (no copy) of a uint8 host array, reinterpreted in the cache dtype."""
        if array.dtype != np.uint8 or array.shape != shape:
            raise ValueError(f"{what} must be uint8 {list(shape)}, got {array.dtype} {list(array.shape)}")
        if array.strides[-1] != 1 or array.strides[-2] != shape[-1]:
            raise ValueError(f"{what}: each Layer Block must be contiguous (strides {array.strides})")
        if not array.flags.writeable:  # a read-only source (import): torch warns, but we only read it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(array).view(self.tensor.dtype)
        return torch.from_numpy(array).view(self.tensor.dtype)

    def _copy_out(self, source: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        if not block_ids:
            return
        runs = _runs(block_ids)
        if source.device.type == "cpu" and len(runs) > MAX_RUN_COPIES:  # scattered ids: one gather
            torch.index_select(source, 0, torch.as_tensor(block_ids, dtype=torch.long), out=host)
            return
        for start, end, first in runs:  # straight into `host`, no staging copy
            host[start:end].copy_(source[first : first + end - start])

    def _copy_in(self, target: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor) -> None:
        if not block_ids:
            return
        runs = _runs(block_ids)
        if target.device.type == "cpu" and len(runs) > MAX_RUN_COPIES:  # scattered ids: one scatter
            target.index_copy_(0, torch.as_tensor(block_ids, dtype=torch.long), host)
            return
        for start, end, first in runs:
            target[first : first + end - start].copy_(host[start:end], non_blocking=False)


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: (start index, end index, first id)."""
    first, n = block_ids[0], len(block_ids)
    if block_ids[-1] - first == n - 1 and list(block_ids) == list(range(first, first + n)):
        return [(0, n, first)]  # the common case, without numpy's fixed costs
    ids = np.asarray(block_ids, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    return [(int(s), int(e), int(ids[s])) for s, e in zip(starts, ends, strict=True)]

"""Pool blocks between registered host memory and a CUDA paged cache in one kernel launch: a layer gather and
a Full Block scatter are byte-exact against the CPU's copies, for scattered slots and cache blocks.
Skipped without a CUDA device and CuPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu import host_gather
from gpu.kv_cache import PagedKVCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not host_gather.available("cuda"), reason="needs a CUDA device and CuPy"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_layers_and_scatter_blocks_are_byte_exact(dtype: str) -> None:
    kv = PagedKVCache(num_blocks=32, num_layers=4, block_size=16, kv_dim=64, dtype=dtype, device="cuda")
    shape = (kv.num_layers, kv.block_size, kv.bytes_per_token_layer)
    devices = [np.zeros((12, kv.full_block_bytes), dtype=np.uint8) for _ in range(2)]  # two "devices"
    rng = np.random.default_rng(3)
    for d in devices:
        d[:] = rng.integers(0, 256, d.shape, dtype=np.uint8)
    registered = host_gather.RegisteredHost(devices)
    try:
        copier = host_gather.BlockCopier(kv)
        sources = [(0, 3), (1, 0), (0, 11), (1, 7), (0, 4)]  # (device, row)
        ptrs = [registered.device_ptrs[d] + row * kv.full_block_bytes for d, row in sources]
        targets = [30, 2, 17, 5, 6]
        prepared = copier.prepare(ptrs, targets)
        for layer in (2, 0):
            copier.gather_layer(prepared, layer)
        torch.cuda.synchronize()
        out = np.empty((len(targets), *shape), dtype=np.uint8)
        kv.export_blocks(targets, out)
        for i, (d, row) in enumerate(sources):
            want = devices[d][row].reshape(shape)
            assert out[i, 2].tobytes() == want[2].tobytes() and out[i, 0].tobytes() == want[0].tobytes()
            assert not out[i, 1].any() and not out[i, 3].any()  # only the gathered layers moved
        fresh = rng.integers(0, 256, (2, *shape), dtype=np.uint8)
        kv.import_blocks([9, 10], fresh)
        dst = [(1, 2), (0, 9)]
        copier.scatter_blocks([9, 10], [registered.device_ptrs[d] + r * kv.full_block_bytes for d, r in dst])
        for i, (d, row) in enumerate(dst):
            assert devices[d][row].tobytes() == fresh[i].tobytes()
    finally:
        registered.close()

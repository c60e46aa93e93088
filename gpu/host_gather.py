"""Many KV blocks between mapped host memory and the paged cache in one kernel launch (Beluga's O5/O6).

The KV pool's memory (CXL devices, or their `/dev/shm` stand-ins) is registered with CUDA as mapped host
memory once (`RegisteredHost`: cudaHostRegister, portable + mapped), so a kernel reads and writes it directly
over the bus with no bounce buffer. `BlockCopier` then moves a whole read in one launch per layer (gather:
Layer Block `layer` of every leased slot into its cache block, before that layer computes) and a whole write
in one launch (scatter: Full Blocks from the cache into their slots), instead of one cudaMemcpy per block or
per run of blocks: with 16-token blocks, per-copy setup is what dominates (paper §5). One CUDA block of
threads moves one KV block with 16-byte loads and stores.

CuPy compiles and launches the kernels on torch's current stream. Without CUDA or without CuPy (`available()`
is False) callers use the cache's own copies (`PagedKVCache.import_layer` per run of slots), as on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gpu.kv_cache import PagedKVCache

_KERNELS = r"""
extern "C" __global__ void gather_layer(const unsigned long long* src, const long long* dst_block,
                                        unsigned long long dst_base, long long src_offset,
                                        long long layer_stride, long long block_stride, long long vectors) {
    const int4* s = reinterpret_cast<const int4*>(src[blockIdx.x] + src_offset);
    int4* d = reinterpret_cast<int4*>(dst_base + dst_block[blockIdx.x] * block_stride + layer_stride);
    for (long long i = threadIdx.x; i < vectors; i += blockDim.x) d[i] = s[i];
}

extern "C" __global__ void scatter_blocks(const long long* src_block, const unsigned long long* dst,
                                          unsigned long long src_base, long long block_stride,
                                          long long vectors) {
    const int4* s = reinterpret_cast<const int4*>(src_base + src_block[blockIdx.x] * block_stride);
    int4* d = reinterpret_cast<int4*>(dst[blockIdx.x]);
    for (long long i = threadIdx.x; i < vectors; i += blockDim.x) d[i] = s[i];
}
"""
_THREADS = 256
_VECTOR = 16  # bytes per load/store (int4)
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2
_ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


def available(device: str) -> bool:
    """Whether `device` is a CUDA device and CuPy can launch kernels on it."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _module() -> Any:
    import cupy

    return cupy.RawModule(code=_KERNELS)


class RegisteredHost:
    """Host arrays registered with CUDA as mapped memory; device addresses for byte offsets inside them."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        import cupy

        self._runtime = cupy.cuda.runtime
        self._hosts: list[int] = []
        self.device_ptrs: list[int] = []
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        try:
            for array in arrays:
                if array.nbytes == 0:
                    self.device_ptrs.append(0)
                    continue
                ptr = array.ctypes.data
                self._runtime.hostRegister(ptr, array.nbytes, flags)
                self._hosts.append(ptr)
                self.device_ptrs.append(self._device_pointer(ptr))
        except Exception:
            self.close()
            raise

    def _device_pointer(self, ptr: int) -> int:
        """The device address of registered host memory: the host address itself where the device can
        use it (unified addressing; CuPy 14 has no hostGetDevicePointer binding), else the runtime's."""
        device = self._runtime.getDevice()
        if self._runtime.deviceGetAttribute(_ATTR_HOST_POINTER_FOR_REGISTERED_MEM, device):
            return ptr
        get = getattr(self._runtime, "hostGetDevicePointer", None)
        if get is None:
            raise RuntimeError("this CUDA device needs cudaHostGetDevicePointer, which this CuPy lacks")
        return int(get(ptr, 0))

    def close(self) -> None:
        hosts, self._hosts = self._hosts, []
        for ptr in hosts:
            self._runtime.hostUnregister(ptr)


class BlockCopier:
    """Gathers and scatters of whole KV blocks between registered host memory and a CUDA paged cache."""

    def __init__(self, kv: PagedKVCache) -> None:
        if kv.layer_block_bytes % _VECTOR or kv.full_block_bytes % _VECTOR:
            raise ValueError(
                f"KV blocks of {kv.layer_block_bytes} bytes are not whole {_VECTOR}-byte vectors"
            )
        self.kv = kv
        self.device_index = kv.tensor.device.index or 0
        module = _module()
        self._gather = module.get_function("gather_layer")
        self._scatter = module.get_function("scatter_blocks")

    def prepare(self, src_ptrs: Sequence[int], block_ids: Sequence[int]) -> tuple[Any, Any]:
        """Device arrays for a read of len(block_ids) blocks: each one's mapped source address (its Full
        Block) and its cache block id. Made once per read, used by every layer's gather."""
        import cupy

        with cupy.cuda.Device(self.device_index), self._stream():
            ptrs = cupy.asarray(np.asarray(src_ptrs, dtype=np.uint64))
            ids = cupy.asarray(np.asarray(block_ids, dtype=np.int64))
        return ptrs, ids

    def gather_layer(self, prepared: tuple[Any, Any], layer: int) -> None:
        """Layer `layer` of every prepared block into the cache, one launch, on torch's current stream."""
        import cupy

        ptrs, ids = prepared
        n = int(ids.size)
        if not n:
            return
        kv = self.kv
        args = (
            ptrs,
            ids,
            np.uint64(kv.tensor.data_ptr()),
            np.int64(layer * kv.layer_block_bytes),
            np.int64(layer * kv.layer_block_bytes),
            np.int64(kv.full_block_bytes),
            np.int64(kv.layer_block_bytes // _VECTOR),
        )
        with cupy.cuda.Device(self.device_index), self._stream():
            self._gather((n,), (_THREADS,), args)

    def scatter_blocks(self, block_ids: Sequence[int], dst_ptrs: Sequence[int]) -> None:
        """Full Blocks `block_ids` of the cache into the mapped destinations, one launch; returns once they
        are there (the host reads them next: checksums, publishing)."""
        import cupy

        if not block_ids:
            return
        kv = self.kv
        stream = self._stream()
        with cupy.cuda.Device(self.device_index), stream:
            ids = cupy.asarray(np.asarray(block_ids, dtype=np.int64))
            ptrs = cupy.asarray(np.asarray(dst_ptrs, dtype=np.uint64))
            args = (ids, ptrs, np.uint64(kv.tensor.data_ptr()), np.int64(kv.full_block_bytes),
                    np.int64(kv.full_block_bytes // _VECTOR))  # fmt: skip
            self._scatter((len(block_ids),), (_THREADS,), args)
        stream.synchronize()

    def _stream(self) -> Any:
        """torch's current stream as a CuPy stream (CuPy 14: Stream.from_external over the CUDA stream
        protocol; before it: ExternalStream, which CuPy 14 deprecates)."""
        import cupy

        ptr = torch.cuda.current_stream(self.kv.tensor.device).cuda_stream
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            return from_external(_StreamHandle(ptr))
        return cupy.cuda.ExternalStream(ptr, self.device_index)


class _StreamHandle:
    """A raw cudaStream_t behind the CUDA stream protocol (`__cuda_stream__`: version 0, the handle)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)

"""KV load bandwidth for `kvpath bench beluga`: the same hit blocks into an engine's cache from each tier.

One bench process plays the engine: a real `PagedKVCache` of the model and the engine's own tier objects
(`PoolTier`, `RemoteTier`, `StorageClient`), against real service processes on a private nats-server
(`kvpath serve cxlpool`, `remotekv` reached over tcp as across a network, `storage`). Every source is
read into the same destination blocks as the colocated connector imports them on the CPU (whole blocks,
one copy per run; on a GPU it goes layer by layer, overlapping compute):
  pool-cold        LOOKUP+pin over CXL-RPC, checksum check of every block, one copy per run of consecutive
                   slots, unpin: a first load (the tier's verified slots are forgotten before each read)
  pool             the same, re-loading blocks it verified before: LOOKUP returns the generations they
                   were verified at, so no block is hashed again (agents re-read their context every turn)
  pool-noverify    the same without the checksum check (`--no-pool-verify-checksums`)
  remote           GET: the store writes the super blocks into the engine's local DRAM cache over tcp, then
                   the per-layer import (two copies); two block sets alternate through a local cache that
                   holds one, so every read misses locally as a working set larger than local DRAM does
  remote-local     the remote tier when its local DRAM cache holds the blocks (its best case)
  storage          the node's storage service reads the block files (page cache warm) into its buffer,
                   then the per-layer import
  import           the same import from a private heap array (the floor of every tier)
  memcpy           one `np.copyto` of the same number of bytes between two heap arrays
With `--load-device cuda` the cache is in GPU memory and every tier's blocks go in layer by layer as an
engine on a GPU imports them (the pool: one gather kernel per layer reading the registered, mapped pool;
the others: one host-to-device copy per layer), and `import` is the same layerwise copy from a heap array.
Each source is timed from its first request to the blocks being in the cache and the lease given back;
sources are interleaved per repeat so that machine noise hits them alike; the median is reported. The
destination is checked against the source blocks after every tier's first read.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.blocks import BlockLayout

SOURCES = ("memcpy", "import", "pool-cold", "pool", "pool-noverify", "remote", "remote-local", "storage")
MODEL = "tiny"  # the pool's slot is one Full Block of this model
_STORE_ID = "remotekv-bench"
_POOL_ID = "pool-bench"
_START_TIMEOUT_S = 90.0


@dataclass(slots=True)
class LoadResult:
    source: str
    block_size: int
    layer_block_bytes: int
    num_blocks: int
    bytes_per_read: int
    median_s: float
    gbps: float  # GB/s (1e9 bytes) of the median read
    ratio_to_memcpy: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_kv_load(block_size: int, num_blocks: int, repeats: int, device: str = "cpu") -> list[LoadResult]:
    return asyncio.run(_measure(block_size, num_blocks, repeats, device))


async def _measure(block_size: int, num_blocks: int, repeats: int, device: str) -> list[LoadResult]:
    from shared.natsserver import NatsServer

    with tempfile.TemporaryDirectory(prefix="kvpath-bench-load-") as tmp:
        (Path(tmp) / "nats").mkdir()
        nats = NatsServer(store_dir=str(Path(tmp) / "nats"), log_path=str(Path(tmp) / "nats.log"))
        nats.start()
        try:
            bench = _LoadBench(Path(tmp), nats, block_size, num_blocks, device)
            try:
                await bench.start()
                return await bench.run(repeats)
            finally:
                await bench.close()
        finally:
            nats.stop()


class _LoadBench:
    def __init__(self, tmp: Path, nats: Any, block_size: int, num_blocks: int, device: str) -> None:
        from gpu.model_spec import load_model_spec, resolve_device
        from services.remotekv.config import DEFAULT_CHUNK_TOKENS
        from services.up.process import ServiceStack

        spec = load_model_spec(MODEL)
        self.device = resolve_device(device)
        self.layerwise = self.device.startswith("cuda")  # as an engine on a GPU imports
        self.kv_dim = spec.kv_dim
        self.layout = BlockLayout(spec.num_layers, block_size, spec.kv_bytes_per_token_layer("float32"))
        self.chunk_blocks = max(1, DEFAULT_CHUNK_TOKENS // block_size)
        self.num_blocks = -(-num_blocks // self.chunk_blocks) * self.chunk_blocks  # whole super blocks
        self.tmp, self.nats = tmp, nats
        self.namespace = "bench" + uuid.uuid4().hex[:8]
        self.stack = ServiceStack(tmp, nats, self.namespace)
        self.fingerprint = f"bench-{uuid.uuid4().hex[:8]}"
        self.closers: list[Callable[[], Awaitable[Any]]] = []

    async def start(self) -> None:
        from gpu.kv_cache import PagedKVCache
        from shared.bus import Bus

        n, layout = self.num_blocks, self.layout
        pool_bytes = 4 * n * layout.full_block_bytes
        self.stack.start(
            "cxlpool", _POOL_ID, "--pool-id", _POOL_ID, "--model", MODEL,
            "--block-size", str(layout.block_size), "--capacity-bytes", str(pool_bytes), "--dtype", "float32",
        )  # fmt: skip
        self.stack.start("remotekv", _STORE_ID, "--capacity-bytes", str(pool_bytes), "--kv-backends", "tcp")
        self.stack.start("storage", "storage-0", "--node", "0", "--root", str(self.tmp / "kv"))
        self.stack.start("index", "index-0")  # the remote tier announces its local cache to it
        self.bus = Bus(self.nats.url, self.namespace, name="bench-engine")
        await self.bus.connect()
        self.closers.append(self.bus.close)
        # blocks [0, n): set A, [n, 2n): set B, [2n, 3n): where every read lands
        self.kv = PagedKVCache(
            num_blocks=3 * n, num_layers=layout.num_layers, block_size=layout.block_size,
            kv_dim=self.kv_dim, dtype="float32", device=self.device,
        )  # fmt: skip
        rng = np.random.default_rng(0)
        self.kv.import_blocks(
            list(range(2 * n)), rng.integers(0, 256, (2 * n, *layout.shape), dtype=np.uint8)
        )
        self.dest = list(range(2 * n, 3 * n))
        self.seqs = [_sequence(f"set-{i}", list(range(i * n, (i + 1) * n)), rng) for i in range(2)]
        await self._wait_services()
        await self._start_pool()
        await self._start_remote()
        await self._start_storage()

    async def _wait_services(self) -> None:
        from shared.bus import Registry
        from shared.errors import ServiceUnavailableError
        from shared.protocol import ServiceInfo

        registry: Registry[ServiceInfo] = Registry(self.bus, ttl_s=5.0)
        await registry.open()
        wanted = {p.service_id for p in self.stack.procs}
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            ready = {s.service_id for s in await registry.list() if s.status == "ready"}
            if wanted <= ready:
                return
            for proc in self.stack.procs:
                if proc.proc.poll() is not None:
                    raise ServiceUnavailableError(f"{proc.service_id} exited:\n{proc.log()}")
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(f"services not ready in time: {sorted(wanted - ready)}")
            await asyncio.sleep(0.1)

    async def _start_pool(self) -> None:
        from services.engine.pool_tier import PoolTier
        from shared.cxl.pool_client import PoolClient

        client = await PoolClient.connect(self.bus, _POOL_ID)
        if not client.is_local:
            raise RuntimeError("the pool's memory is not mappable from the bench process")
        self.pool = PoolTier(client, self.layout, self.kv, verify_checksums=True, lease_ms=30_000)
        self.closers.append(self.pool.close)
        wait = self.pool.write(self.seqs[0], 0, self.num_blocks, self.seqs[0].block_hashes[0] ^ 1)
        if wait is not None:
            await wait

    async def _start_remote(self) -> None:
        from services.engine.remote_client import ChunkFormat, RemoteStoreClient
        from services.engine.remote_events import CacheAnnouncer
        from services.engine.remote_tier import RemoteTier
        from services.remotekv.config import DEFAULT_CHUNK_TOKENS
        from shared.transport import KvReceiver, KvSender, TransportConfig

        config = TransportConfig(backends=["tcp"])
        self.rx, self.tx = (
            KvReceiver(config, receiver_id="bench-engine"),
            KvSender(config, sender_id="bench-engine"),
        )
        await self.rx.start()
        self.closers += [self.rx.close, self.tx.close]
        chunk_bytes = self.chunk_blocks * self.layout.full_block_bytes
        fmt = ChunkFormat(self.fingerprint, DEFAULT_CHUNK_TOKENS, chunk_bytes)
        client = RemoteStoreClient(self.bus, _STORE_ID, self.tx, fmt, timeout_s=10.0)
        self.remote = RemoteTier(
            client, self.rx, CacheAnnouncer(self.bus, "bench-engine", block_tokens=self.layout.block_size),
            self.layout, self.kv, engine_id="bench-engine", seed=1, chunk_blocks=self.chunk_blocks,
            cache_bytes=self.num_blocks * self.layout.full_block_bytes,
        )  # fmt: skip
        self.closers.append(self.remote.close)
        await self.remote.start()
        for seq in self.seqs:  # B's upload evicts A from the local cache (it holds one set)
            wait = self.remote.write(seq, 0, self.num_blocks, 1)
            if wait is not None:
                await wait
        self._remote_turn = 0

    async def _start_storage(self) -> None:
        from shared.kvclient import StorageClient

        self.storage = StorageClient(self.bus, 0, self.layout, self.fingerprint, owner_id="bench-engine")
        await self.storage.start()
        self.closers.append(self.storage.close)
        seq = self.seqs[0]
        staged = self.storage.stage(self.num_blocks)
        self.kv.export_blocks(seq.block_ids, staged.views)
        await self.storage.write(staged, seq.block_hashes, [1, *seq.block_hashes[:-1]], timeout_s=30.0)

    async def close(self) -> None:
        for close in reversed(self.closers):
            try:
                await close()
            except Exception:  # a bench tears down what it can
                pass
        self.stack.stop()

    # ------------------------------------------------------------------------------------------- runs

    async def run(self, repeats: int) -> list[LoadResult]:
        n, layout = self.num_blocks, self.layout
        nbytes = layout.blocks_bytes(n)
        heap_src = np.empty((n, *layout.shape), dtype=np.uint8)
        self.kv.export_blocks(self.seqs[0].block_ids, heap_src)
        heap_dst = np.empty_like(heap_src)
        runs: dict[str, Callable[[], Awaitable[int]]] = {
            "memcpy": lambda: _sync(lambda: np.copyto(heap_dst, heap_src)),
            "import": lambda: _sync(lambda: self._import_heap(heap_src)),
            "pool-cold": lambda: self._pool(verify=True, cold=True),
            "pool": lambda: self._pool(verify=True),
            "pool-noverify": lambda: self._pool(verify=False),
            "remote": self._remote_miss,
            "remote-local": self._remote_local,
            "storage": self._storage,
        }
        times: dict[str, list[float]] = {s: [] for s in SOURCES}
        for rep in range(repeats + 1):  # the first round warms up and checks the bytes
            for source in SOURCES:
                self.kv.tensor[2 * n : 3 * n].zero_()  # (the destination blocks)
                started = time.perf_counter()
                expect_set = await runs[source]()
                self.kv.synchronize()
                elapsed = time.perf_counter() - started
                if rep == 0:
                    self._check(source, expect_set)
                else:
                    times[source].append(elapsed)
        memcpy_s = statistics.median(times["memcpy"])
        return [
            LoadResult(
                source=s,
                block_size=layout.block_size,
                layer_block_bytes=layout.layer_block_bytes,
                num_blocks=n,
                bytes_per_read=nbytes,
                median_s=statistics.median(times[s]),
                gbps=nbytes / statistics.median(times[s]) / 1e9,
                ratio_to_memcpy=memcpy_s / statistics.median(times[s]),
            )
            for s in SOURCES
        ]

    def _check(self, source: str, expect_set: int) -> None:
        if source == "memcpy":
            return
        want = np.empty((self.num_blocks, *self.layout.shape), dtype=np.uint8)
        got = np.empty_like(want)
        self.kv.export_blocks(self.seqs[expect_set].block_ids, want)
        self.kv.export_blocks(self.dest, got)
        if not np.array_equal(want, got):
            raise RuntimeError(f"kv load bench: {source} did not load the stored blocks")

    def _import_heap(self, heap: np.ndarray) -> int:
        self._import(heap)
        return 0

    def _import(self, blocks: np.ndarray) -> None:
        """(blocks, layers, ...) host blocks into the destination: whole blocks, or layer by layer."""
        if not self.layerwise:
            self.kv.import_blocks(self.dest, blocks)
            return
        for layer in range(self.layout.num_layers):
            self.kv.import_layer(self.dest, layer, blocks[:, layer])

    async def _pool(self, *, verify: bool, cold: bool = False) -> int:
        self.pool.verify_checksums = verify
        if cold:
            self.pool.verified.forget()
        hashed = self.pool.verified.num_hashed
        read = await self.pool.read(self.seqs[0], self.num_blocks)
        if read is None or read.num_blocks != self.num_blocks:
            raise RuntimeError(f"pool held {read.num_blocks if read else 0} of {self.num_blocks} blocks")
        if self.layerwise:
            for layer in range(self.layout.num_layers):
                self.pool.import_layer(self.dest, read, layer)
        else:
            self.pool.import_blocks(self.dest, read)
        self.kv.synchronize()  # the gather kernels read the leased slots: done before the lease ends
        self.pool.release(read)
        hashed = self.pool.verified.num_hashed - hashed
        if verify and hashed != (self.num_blocks if cold else 0):
            raise RuntimeError(f"pool read hashed {hashed} of {self.num_blocks} blocks (cold={cold})")
        return 0

    async def _remote_read(self, which: int) -> int:
        read = await self.remote.read(self.seqs[which], self.num_blocks)
        if read is None or read.num_blocks != self.num_blocks:
            got = read.num_blocks if read else 0
            raise RuntimeError(f"remote store held {got} of {self.num_blocks} blocks")
        if self.layerwise:
            for layer in range(self.layout.num_layers):
                self.remote.import_layer(self.dest, read, layer)
        else:
            self.remote.import_blocks(self.dest, read)
        self.remote.release(read)
        return which

    async def _remote_miss(self) -> int:
        self._remote_turn ^= 1  # the other set: not in the local cache, which holds the last one read
        return await self._remote_read(self._remote_turn)

    async def _remote_local(self) -> int:
        return await self._remote_read(self._remote_turn)  # the set just read: a local DRAM hit

    async def _storage(self) -> int:
        seq = self.seqs[0]
        lease = await self.storage.read(uuid.uuid4().hex, seq.block_hashes, deadline_s=30.0)
        try:
            if lease.num_blocks != self.num_blocks:
                raise RuntimeError(f"storage held {lease.num_blocks} of {self.num_blocks} blocks")
            self._import(lease.views)
        finally:
            await lease.release()
        return 0


async def _sync(fn: Callable[[], Any]) -> int:
    fn()
    return 0


def _sequence(request_id: str, block_ids: list[int], rng: np.random.Generator) -> Any:
    from services.engine.sequence import Sequence
    from shared.protocol.messages import SamplingParams
    from shared.protocol.tasks import RequestPlan

    plan = RequestPlan(
        request_id=request_id,
        router_id="bench",
        prompt_token_ids=[0],
        sampling=SamplingParams(max_tokens=1),
        deadline_unix_s=time.time() + 3600,
    )
    hashes = [int(h) for h in rng.integers(1, 2**62, len(block_ids))]
    return Sequence(plan=plan, arrived_at=0.0, block_ids=block_ids, block_hashes=hashes)

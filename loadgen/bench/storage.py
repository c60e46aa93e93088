"""`kvpath bench storage`: read throughput through the storage service vs raw reads of the same files.

One run: start a nats-server (or use --nats-url) and a storage service in-process, write --blocks Full
Blocks through it, then, after one uncounted warm-up of each, alternate two measurements --repeat times
over the same files:
  raw      open + one preadv per file into a preallocated buffer, with the service's I/O concurrency;
  service  StorageClient.read of --request-blocks blocks per request, --concurrency requests in flight,
           each leased into the node buffer (checksums verified) and released.
Both are warm (page cache) unless --drop-caches succeeds before every measurement (needs root).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from services.storage.block_store import HEADER_BYTES
from services.storage.config import StorageConfig
from services.storage.service import StorageService
from shared.blocks import BlockLayout
from shared.bus import Bus
from shared.hashing import block_hashes, block_parents, fingerprint_seed, model_fingerprint
from shared.kvclient import StorageClient
from shared.natsserver import NatsServer


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("storage", help="storage read throughput: service path vs raw file reads")
    p.add_argument("--blocks", type=int, default=512, help="Full Blocks to write and read")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64, help="tokens per block")
    p.add_argument("--bytes-per-token-layer", type=int, default=1024)
    p.add_argument("--request-blocks", type=int, default=64, help="blocks per read request")
    p.add_argument("--concurrency", type=int, default=4, help="read requests in flight")
    p.add_argument("--io-threads", type=int, default=8, help="max_concurrent_reads (and raw read threads)")
    p.add_argument("--repeat", type=int, default=5, help="alternating raw/service rounds; the median is kept")
    p.add_argument("--root", default="", help="directory for the block files (default: a temp dir)")
    p.add_argument("--nats-url", default="", help="use this NATS server instead of starting one")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before each round")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.set_defaults(func=lambda args: asyncio.run(run(args)))


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _raw_read(paths: list[Path], dest: np.ndarray, block_bytes: int, threads: int) -> float:
    """Read every file (header + payload) with `threads` threads; return payload bytes/s.

    File i lands in slot i of `dest` modulo its size: the same memory footprint the service's node
    buffer has (requests in flight x blocks per request), so both pay the same cache misses.
    """
    num_slots = dest.size // block_bytes
    views = [dest[i * block_bytes : (i + 1) * block_bytes].data for i in range(num_slots)]
    heads = [bytearray(HEADER_BYTES) for _ in range(num_slots)]

    def read_one(i: int) -> int:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            return os.preadv(fd, [heads[i % num_slots], views[i % num_slots]], 0)
        finally:
            os.close(fd)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read_one, range(len(paths))))
    elapsed = time.perf_counter() - started
    assert total == len(paths) * (HEADER_BYTES + block_bytes), "short raw read"
    return len(paths) * block_bytes / elapsed


async def _service_read(
    client: StorageClient, hashes: list[int], request_blocks: int, concurrency: int
) -> float:
    chunks = [hashes[i : i + request_blocks] for i in range(0, len(hashes), request_blocks)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    read_blocks = 0

    async def worker() -> None:
        nonlocal read_blocks
        while not queue.empty():
            chunk = queue.get_nowait()
            lease = await client.read(uuid.uuid4().hex, chunk, deadline_s=120.0)
            read_blocks += lease.num_blocks
            await lease.release()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    assert read_blocks == len(hashes), f"service read {read_blocks} of {len(hashes)} blocks"
    return read_blocks * client.layout.full_block_bytes / elapsed


@contextlib.asynccontextmanager
async def _nats(url: str) -> AsyncIterator[str]:
    if url:
        yield url
        return
    server = NatsServer().start()
    try:
        yield server.url
    finally:
        server.stop()


async def run(args: argparse.Namespace) -> int:
    layout = BlockLayout(args.layers, args.block_size, args.bytes_per_token_layer)
    fp = model_fingerprint("bench", dtype="bytes", block_size=args.block_size, num_layers=args.layers)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="kvpath-bench-storage-"))
    namespace = "bench" + uuid.uuid4().hex[:8]
    buffer_bytes = (args.concurrency + 1) * args.request_blocks * layout.full_block_bytes + (1 << 20)
    async with _nats(args.nats_url) as url:
        config = StorageConfig(
            nats_url=url,
            namespace=namespace,
            root=str(root),
            buffer_bytes=buffer_bytes,
            max_concurrent_reads=args.io_threads,
            fsync_policy="none",
        )
        service = StorageService(config)
        await service.start()
        bus = Bus(url, namespace, name="bench-client", request_timeout_s=120.0)
        await bus.connect()
        client = StorageClient(
            bus, 0, layout, fp, staging_bytes=args.request_blocks * layout.full_block_bytes
        )
        await client.start()
        try:
            results = await _measure(args, client, service, layout, fp)
        finally:
            await client.close()
            await bus.close()
            await service.stop()
            if not args.root:
                shutil.rmtree(root, ignore_errors=True)
    _report(args, layout, results)
    return 0


async def _measure(
    args: argparse.Namespace, client: StorageClient, service: StorageService, layout: BlockLayout, fp: str
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 100_000, size=args.blocks * layout.block_size)
    hashes = block_hashes(tokens, layout.block_size, fp)
    parents = block_parents(hashes, fp)
    payload = rng.integers(0, 256, size=(args.request_blocks, *layout.shape), dtype=np.uint8)
    write_s = 0.0
    for i in range(0, len(hashes), args.request_blocks):
        n = len(hashes[i : i + args.request_blocks])
        staged = client.stage(n)
        staged.views[:] = payload[:n]
        staged.views[:, 0, 0, :8] = np.arange(i, i + n, dtype=np.uint64).view(np.uint8).reshape(n, 8)
        started = time.perf_counter()
        await client.write(staged, hashes[i : i + n], parents[i : i + n])
        write_s += time.perf_counter() - started
    fp_hash = fingerprint_seed(fp)
    paths = [service.store.path_for(fp_hash, h) for h in hashes]
    dest = np.zeros(args.concurrency * args.request_blocks * layout.full_block_bytes, dtype=np.uint8)
    # warm-up (not counted): faults in the destination pages of both paths and the node buffer
    await asyncio.to_thread(_raw_read, paths, dest, layout.full_block_bytes, args.io_threads)
    await _service_read(client, hashes, args.request_blocks, args.concurrency)
    raw, served, dropped = [], [], []
    for _ in range(args.repeat):
        dropped.append(_drop_caches() if args.drop_caches else False)
        raw.append(await asyncio.to_thread(_raw_read, paths, dest, layout.full_block_bytes, args.io_threads))
        dropped.append(_drop_caches() if args.drop_caches else False)
        served.append(await _service_read(client, hashes, args.request_blocks, args.concurrency))
    return {
        "write_bytes_per_s": len(hashes) * layout.full_block_bytes / write_s,
        "raw_bytes_per_s": statistics.median(raw),
        "service_bytes_per_s": statistics.median(served),
        "raw_rounds": raw,
        "service_rounds": served,
        "page_cache": "dropped" if dropped and all(dropped) else "warm",
    }


def _report(args: argparse.Namespace, layout: BlockLayout, r: dict[str, Any]) -> None:
    ratio = r["service_bytes_per_s"] / r["raw_bytes_per_s"]
    out = {
        "blocks": args.blocks,
        "block_bytes": layout.full_block_bytes,
        "total_bytes": args.blocks * layout.full_block_bytes,
        "request_blocks": args.request_blocks,
        "concurrency": args.concurrency,
        "io_threads": args.io_threads,
        **r,
        "service_vs_raw": ratio,
    }
    gib = 1024**3
    print(
        f"storage bench: {args.blocks} blocks x {layout.full_block_bytes / 2**20:.2f} MiB "
        f"({out['total_bytes'] / gib:.2f} GiB), page cache {r['page_cache']}, {args.repeat} rounds (median)"
    )
    print(f"  write through service : {r['write_bytes_per_s'] / gib:7.2f} GiB/s (fsync_policy=none)")
    print(f"  raw preadv            : {r['raw_bytes_per_s'] / gib:7.2f} GiB/s")
    print(f"  service read path     : {r['service_bytes_per_s'] / gib:7.2f} GiB/s")
    print(f"  service / raw         : {100 * ratio:6.1f} %  (target >= 70 %)")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))

"""`kvpath bench index`: memory per indexed block and prefix-match latency.

Builds an index of --blocks random block hashes through the same path the service uses (BlockStored
events of --event-blocks hashes each), then measures process RSS (psutil) and the latency of matching
--chain-long hash chains in-process. The chains are 64 events' hashes spread evenly over the build (what
was stored early sits in its own slot more often than what came late, so the first events alone flatter
the table); `match_recent_u64` takes the last 64 events (a session's latest blocks, stored into the
fullest table). Half-hit chains have their second half unknown. Matches take the chain as a list of ints
(as decoded from a request) and, `match_full_hit_u64`, as a uint64 array (the conversion, ~8 us per 512
hashes, is then the caller's). With --bus it also times `IndexClient.match` round trips to an in-process
index service over NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil

from services.index.index import BlockIndex
from shared.protocol.kv import BlockStored


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("index", help="index memory per block and prefix-match latency")
    p.add_argument("--blocks", type=int, default=1_000_000, help="block hashes to index")
    p.add_argument("--chain", type=int, default=512, help="hashes per match request")
    p.add_argument("--matches", type=int, default=2000, help="timed matches per kind")
    p.add_argument("--event-blocks", type=int, default=512, help="hashes per BlockStored event")
    p.add_argument("--bus", action="store_true", help="also time match round trips over NATS")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.set_defaults(func=run)


def _build(
    num_blocks: int, event_blocks: int, chain: int
) -> tuple[BlockIndex, list[np.ndarray], list[np.ndarray], float]:
    """Index `num_blocks` random hashes; keep the first `chain` hashes of 64 events spread evenly over the
    build and of the last 64, as arrays (lists of ints would count in the RSS measured)."""
    index = BlockIndex()
    rng = np.random.default_rng(0)
    starts = range(0, num_blocks, event_blocks)
    spread = {int(i) for i in np.linspace(0, len(starts) - 1, 64)}
    recent = set(range(max(0, len(starts) - 64), len(starts)))
    kept: dict[int, np.ndarray] = {}
    started = time.perf_counter()
    for event, start in enumerate(starts):
        hashes = rng.integers(
            0, 2**64 - 1, size=min(event_blocks, num_blocks - start), dtype=np.uint64, endpoint=True
        )
        index.apply(
            BlockStored(
                source="bench", epoch=1, seq=event + 1, location="store", block_hashes=hashes.tolist()
            )
        )
        if (event in spread or event in recent) and hashes.size >= chain:
            kept[event] = hashes[:chain].copy()
    build_s = time.perf_counter() - started
    return (
        index,
        [kept[e] for e in sorted(spread) if e in kept],
        [kept[e] for e in sorted(recent) if e in kept],
        build_s,
    )


def _time_matches(index: BlockIndex, chains: list[list[int]] | list[np.ndarray], n: int) -> np.ndarray:
    out = np.empty(n)
    for i in range(n):
        chain = chains[i % len(chains)]
        t0 = time.perf_counter()
        index.match(chain)
        out[i] = time.perf_counter() - t0
    return out


async def _time_bus_matches(index: BlockIndex, chains: list[list[int]], n: int) -> np.ndarray:
    from services.index.config import IndexConfig
    from services.index.service import IndexService
    from shared.bus import Bus
    from shared.kvclient import IndexClient
    from shared.natsserver import NatsServer

    namespace = "bench" + uuid.uuid4().hex[:8]
    with NatsServer() as server:
        service = IndexService(IndexConfig(nats_url=server.url, namespace=namespace))
        await service.start()
        service.index = index  # serve the prebuilt index (the stream is empty)
        bus = Bus(server.url, namespace, name="bench-client")
        await bus.connect()
        client = IndexClient(bus)
        out = np.empty(n)
        try:
            for i in range(n):
                t0 = time.perf_counter()
                await client.match(chains[i % len(chains)])
                out[i] = time.perf_counter() - t0
        finally:
            await bus.close()
            await service.stop()
    return out


def _us(samples: np.ndarray) -> dict[str, float]:
    return {
        "p50_us": float(np.percentile(samples, 50) * 1e6),
        "p99_us": float(np.percentile(samples, 99) * 1e6),
    }


def run(args: argparse.Namespace) -> int:
    proc = psutil.Process()
    gc.collect()
    rss_before = proc.memory_info().rss
    index, spread, recent, build_s = _build(args.blocks, args.event_blocks, args.chain)
    gc.collect()
    rss_after = proc.memory_info().rss
    chains = [c.tolist() for c in spread]
    half = [c[: args.chain // 2] + [int(h) ^ 0x5A5A for h in c[args.chain // 2 :]] for c in chains]
    assert (
        index.match(chains[0]).num_hit_blocks == args.chain
        and index.match(half[0]).num_hit_blocks < args.chain
        and index.match(recent[-1]).num_hit_blocks == args.chain
    )
    _time_matches(index, chains, 100)  # warm up
    out: dict[str, Any] = {
        "blocks": len(index),
        "chain": args.chain,
        "build_s": build_s,
        "build_blocks_per_s": len(index) / build_s,
        "table_bytes": index.nbytes,
        "table_bytes_per_block": index.nbytes / len(index),
        "rss_bytes": rss_after,
        "rss_delta_bytes_per_block": (rss_after - rss_before) / len(index),
        "match_full_hit": _us(_time_matches(index, chains, args.matches)),
        "match_half_hit": _us(_time_matches(index, half, args.matches)),
        # the same chains as uint64 arrays (what the service's handler passes after its range check)
        "match_full_hit_u64": _us(_time_matches(index, spread, args.matches)),
        "match_recent_u64": _us(_time_matches(index, recent, args.matches)),
    }
    if args.bus:
        out["match_over_bus"] = _us(asyncio.run(_time_bus_matches(index, chains, args.matches)))
    _print(out)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0


def _print(out: dict[str, Any]) -> None:
    mib = 2**20
    print(f"index bench: {out['blocks']:,} blocks, chains of {out['chain']} hashes")
    print(
        f"  build                 : {out['build_s']:.2f} s ({out['build_blocks_per_s'] / 1e6:.2f} M blocks/s)"
    )
    print(
        f"  memory                : process RSS {out['rss_bytes'] / mib:.1f} MiB (target <= 200 MB); "
        f"table {out['table_bytes'] / mib:.1f} MiB = {out['table_bytes_per_block']:.1f} B/block; "
        f"RSS growth {out['rss_delta_bytes_per_block']:.1f} B/block"
    )
    for kind in (
        "match_full_hit",
        "match_half_hit",
        "match_full_hit_u64",
        "match_recent_u64",
        "match_over_bus",
    ):
        if kind in out:
            p = out[kind]
            print(f"  {kind:<22}: p50 {p['p50_us']:8.1f} us   p99 {p['p99_us']:8.1f} us")

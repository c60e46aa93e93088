"""A KV receiver or sender in its own process, driven by the multi-process transport tests.

  receiver --backends shm,tcp --size N      prints its endpoint as one JSON line, then serves commands
                                            read from stdin, one per line, answering one JSON line each:
                                              wait <tag> <timeout_s> [peer_id]  -> notice fields or error
                                              digest <offset> <length>          -> xxh3_64 of those bytes
  sender --endpoint JSON --backend B --sender-id ID --seed S --size N [--loop]
                                            writes pattern(S, N) at offset 0 in 1 MiB pieces with tag 1,
                                            then 2000 small scattered blocks with tag 2, prints "done";
                                            with --loop it prints "ready" after the first write and keeps
                                            writing (tags from 1000 up) until killed.
The pattern is numpy's default_rng(seed) bytes, so both sides know the expected bytes without sending them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np
import xxhash

from shared.errors import KvpathError
from shared.transport import KvReceiver, KvSender, TransportConfig

PIECE = 1 << 20


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def small_blocks(seed: int) -> tuple[list[int], np.ndarray]:
    """2000 blocks of 512 bytes at scattered offsets above 64 MiB."""
    rng = np.random.default_rng(seed + 1)
    offsets = (64 << 20) + rng.permutation(4000)[:2000] * 1024
    return offsets.tolist(), rng.integers(0, 256, (2000, 512), dtype=np.uint8)


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def run_receiver(args: argparse.Namespace) -> None:
    rx = KvReceiver(TransportConfig(backends=args.backends.split(",")), receiver_id="rx-proc")
    await rx.start()
    region = rx.register_region("buf", args.size)
    emit(rx.endpoint())
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).split():
        if line[0] == "wait":
            peer_id = line[3] if len(line) > 3 else None
            try:
                notice = await rx.wait("buf", int(line[1]), timeout_s=float(line[2]), peer_id=peer_id)
            except KvpathError as exc:
                emit({"error": type(exc).__name__, "message": exc.message})
                continue
            emit(
                {
                    "tag": notice.tag,
                    "meta": notice.meta.decode(),
                    "nbytes": notice.nbytes,
                    "peer": notice.peer_id,
                }
            )
        elif line[0] == "digest":
            emit({"digest": xxhash.xxh3_64_hexdigest(region.view(int(line[1]), int(line[2])))})
    await rx.close()


async def run_sender(args: argparse.Namespace) -> None:
    tx = KvSender(TransportConfig(backends=["shm", "tcp"]), sender_id=args.sender_id)
    peer = await tx.connect(json.loads(args.endpoint), timeout_s=10, backend=args.backend)
    data = pattern(args.seed, args.size)
    pieces = [(o, data[o : o + PIECE]) for o in range(0, args.size, PIECE)]
    await peer.write_many("buf", pieces, tag=1, meta=b"big", timeout_s=60)
    if args.loop:
        emit("ready")
        tag = 1000
        while True:
            await peer.write("buf", 0, data[:PIECE], tag=tag, timeout_s=60)
            tag += 1
    offsets, blocks = small_blocks(args.seed)
    await peer.write_many("buf", list(zip(offsets, blocks, strict=True)), tag=2, meta=b"small", timeout_s=60)
    emit("done")
    await tx.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["receiver", "sender"])
    parser.add_argument("--backends", default="shm,tcp")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--sender-id", default="pe-proc")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=32 << 20)
    parser.add_argument("--loop", action="store_true")
    args = parser.parse_args()
    asyncio.run(run_receiver(args) if args.role == "receiver" else run_sender(args))


if __name__ == "__main__":
    main()

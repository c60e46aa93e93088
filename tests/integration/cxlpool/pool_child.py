"""A pool client process for the concurrency tests: writes or reads random chains for a while, checking bytes.

    python -m tests.integration.cxlpool.pool_child write|read|pin NATS_URL NAMESPACE POOL_ID SECONDS SEED

Every block's bytes are its hash repeated (so a reader can tell a torn, stale or foreign block from the right
one) and its committed checksum is the xxh3 of those bytes. `write` allocates chains, fills the slots and
commits them; `read` looks chains up with a pin, checks every hit block against its hash and checksum, and
unpins; `pin` pins one chain, prints "pinned", and sleeps until it is killed. Prints one JSON line of counts.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import numpy as np
import orjson
import xxhash

from shared.bus import Bus
from shared.cxl.pool_client import PoolClient

CHAINS = 24
CHAIN_BLOCKS = 6
SEED = 7


def chain(name: int) -> tuple[list[int], list[int]]:
    hashes = [(name << 16) + i + 1 for i in range(CHAIN_BLOCKS)]
    return hashes, [SEED, *hashes[:-1]]


def expected(slot_bytes: int, h: int) -> np.ndarray:
    return np.full(slot_bytes // 8, h, dtype="<u8").view(np.uint8)


async def write(client: PoolClient, rng: random.Random, until: float) -> dict[str, int]:
    assert client.memory is not None
    counts = {"allocated": 0, "committed": 0, "no_room": 0}
    while time.monotonic() < until:
        hashes, parents = chain(rng.randrange(CHAINS))
        slots = client.alloc_now(hashes, parents, lease_ms=5000, timeout_s=1.0)
        mine = [(h, int(s)) for h, s in zip(hashes, slots, strict=True) if s >= 0]
        counts["no_room"] += slots.count(-2)
        checksums = []
        for h, slot in mine:
            view = client.memory.slot(slot)
            view[:] = expected(view.size, h)
            checksums.append(xxhash.xxh3_64_intdigest(view.data))
        counts["allocated"] += len(mine)
        if mine:
            generations = await client.commit([h for h, _ in mine], checksums, timeout_s=1.0)
            counts["committed"] += sum(1 for g in generations if g)
        await asyncio.sleep(0)
    return counts


async def read(client: PoolClient, rng: random.Random, until: float) -> dict[str, int]:
    assert client.memory is not None
    counts = {"lookups": 0, "hit_blocks": 0, "bad_blocks": 0}
    while time.monotonic() < until:
        hashes, _ = chain(rng.randrange(CHAINS))
        reply = await client.lookup(hashes, pin=True, lease_ms=5000, timeout_s=1.0)
        counts["lookups"] += 1
        for h, slot, checksum in zip(hashes, reply.slots, reply.checksums, strict=False):
            view = client.memory.slot(slot)
            if (
                not np.array_equal(view, expected(view.size, h))
                or xxhash.xxh3_64_intdigest(view.data) != checksum
            ):
                counts["bad_blocks"] += 1
            counts["hit_blocks"] += 1
        if reply.lease_id:
            await client.unpin(reply.lease_id, timeout_s=1.0)
    return counts


async def pin(client: PoolClient) -> dict[str, int]:
    """Pin the first chain the pool holds, for 10 minutes (only the process's death ends it sooner)."""
    pinned = 0
    for name in range(CHAINS):
        reply = await client.lookup(chain(name)[0], pin=True, lease_ms=600_000, timeout_s=1.0)
        if reply.slots:
            pinned = len(reply.slots)
            break
    print(orjson.dumps({"pinned": pinned}).decode(), flush=True)
    await asyncio.sleep(3600)
    return {}


async def main(mode: str, nats_url: str, namespace: str, pool_id: str, seconds: float, seed: int) -> None:
    bus = Bus(nats_url, namespace, name=f"pool-child-{mode}-{seed}")
    await bus.connect()
    client = await PoolClient.connect(bus, pool_id)
    assert client.is_local, "the test pool is on this host: operations must go through shared memory"
    rng = random.Random(seed)
    until = time.monotonic() + seconds
    try:
        if mode == "pin":
            counts = await pin(client)
        else:
            counts = await (write(client, rng, until) if mode == "write" else read(client, rng, until))
    finally:
        client.close()
        await bus.close()
    print(orjson.dumps(counts).decode(), flush=True)


if __name__ == "__main__":
    mode, url, ns, pool, secs, seed_ = sys.argv[1:7]
    asyncio.run(main(mode, url, ns, pool, float(secs), int(seed_)))

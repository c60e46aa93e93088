"""The KV pool as a tier of an engine (Beluga): read hit blocks straight from pool memory into the paged
cache, write finished blocks straight from the cache into pool slots.

Reads: LOOKUP pins the longest prefix of the sequence's block hashes the pool holds (a read lease, so
eviction cannot take them while they are copied); the blocks are numpy views of the mapped slots, imported
into the cache layer by layer (one copy per run of consecutive slots: no intermediate buffer) and the lease
ends. A block whose checksum does not match ends the prefix there (corrupt KV is a miss). A block is hashed
once per commit and engine: LOOKUP returns each hit's commit generation, the pool never lets a committed
slot change (a slot whose writer's allocation expired is not reused until that writer stopped), so a slot
verified at a generation is not hashed again while the pool returns that generation (`VerifiedSlots`;
agents re-read the same context every turn). The writer hashed its blocks from the slots to commit them and
COMMIT answers their generations, so it counts them verified; every other engine verifies them on its first
load. A slot freed and committed again has a new generation and is verified again.
Writes: ALLOC (synchronous over the shared-memory RPC: µs, on the event loop between steps) hands out slots
for blocks the pool lacks; the cache exports into them directly, and COMMIT publishes them with their
checksums in the background. Any pool failure is a miss or a skipped write, counted, never a failed
request: storage below still has what it had.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from gpu import host_gather
from services.engine import metrics
from services.engine.sequence import Sequence
from shared.background import Background
from shared.blocks import BlockLayout
from shared.cxl.pool_client import PoolClient
from shared.cxl.pool_memory import PoolMemory
from shared.cxl.prefault import Prefaulter
from shared.errors import KvpathError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 0.05  # a pool operation past this is a miss (the pool is local: µs when healthy)


@dataclass(slots=True)
class PoolRead:
    """Blocks leased from the pool for one sequence: the first `num_blocks` of its chain."""

    lease_id: int
    slots: list[int]
    runs: list[tuple[int, int, np.ndarray]]  # (first block, count, [count, L, bs, bytes] view of the slots)
    gather: Any = None  # on CUDA: the device-side source addresses, once the cache blocks are known

    @property
    def num_blocks(self) -> int:
        return len(self.slots)


def block_checksum(block: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(block.data)


class VerifiedSlots:
    """The commit (generation, checksum) at which each pool slot's bytes were last found to match: 16 bytes
    per slot of the pool, so bounded by the pool's size; generation 0 (never issued) means not verified."""

    def __init__(self, num_slots: int) -> None:
        self._generations = np.zeros(num_slots, dtype=np.uint64)
        self._checksums = np.zeros(num_slots, dtype=np.uint64)
        self.num_hashed = 0  # blocks hashed (first loads of a commit)
        self.num_skipped = 0  # blocks trusted without hashing (re-loads of a verified commit)

    def verified_prefix(
        self, memory: PoolMemory, slots: list[int], checksums: list[int], generations: list[int]
    ) -> int:
        """How many leading blocks match their committed checksums, hashing only those not verified at
        their current generation."""
        index = np.asarray(slots, dtype=np.int64)
        want_generations = np.asarray(generations, dtype=np.uint64)
        want_checksums = np.asarray(checksums, dtype=np.uint64)
        known = (self._generations[index] == want_generations) & (self._checksums[index] == want_checksums)
        for i in np.flatnonzero(~known).tolist():
            self.num_hashed += 1
            if block_checksum(memory.slot(slots[i])) != checksums[i]:
                self.num_skipped += int(known[:i].sum())
                return i
            self._generations[slots[i]] = want_generations[i]
            self._checksums[slots[i]] = want_checksums[i]
        self.num_skipped += int(known.sum())
        return len(slots)

    def mark(self, slots: list[int], checksums: list[int], generations: list[int]) -> None:
        """The writer's own blocks, committed at `generations` (0: not committed) with checksums it computed
        from the slots' bytes after copying them: verified at those generations."""
        index, gens = np.asarray(slots, dtype=np.int64), np.asarray(generations, dtype=np.uint64)
        done = gens != 0
        self._generations[index[done]] = gens[done]
        self._checksums[index[done]] = np.asarray(checksums, dtype=np.uint64)[done]

    def forget(self) -> None:
        """Verify every block again (benchmarks' first loads)."""
        self._generations[:] = 0


class PoolTier:
    def __init__(
        self,
        client: PoolClient,
        layout: BlockLayout,
        kv: Any,
        *,
        verify_checksums: bool,
        lease_ms: int,
        prefault: bool = False,
    ) -> None:
        assert client.memory is not None, "a pool tier needs the pool's memory mapped"
        self.client = client
        self.memory: PoolMemory = client.memory
        self.prefaulter = Prefaulter(self.memory.devices).start() if prefault else None
        self.layout = layout
        self.kv = kv
        self.verify_checksums = verify_checksums
        self.verified = VerifiedSlots(self.memory.geometry.num_slots)
        self.lease_ms = lease_ms
        self._background = Background()
        self._copier: Any = (
            None  # CUDA: one kernel launch per layer of a read, per write (gpu/host_gather.py)
        )
        self._registered: Any = None
        if host_gather.available(kv.device):
            try:
                self._registered = host_gather.RegisteredHost(self.memory.devices)
                self._copier = host_gather.BlockCopier(kv)
            except Exception as exc:  # registration or the kernels' compile: copy per run instead
                log.warning("pool memory not mapped into %s (%r): copies per run of slots", kv.device, exc)
                if self._registered is not None:
                    self._registered.close()
                self._registered = self._copier = None

    # ------------------------------------------------------------------------------------------ read

    async def read(self, seq: Sequence, num_blocks: int) -> PoolRead | None:
        """Lease the longest prefix of the sequence's first `num_blocks` blocks the pool holds."""
        if num_blocks <= 0:
            return None
        hashes, client = seq.block_hashes[:num_blocks], self.client
        try:
            if client.is_local:  # synchronous: bounded by CALL_TIMEOUT_S, usually well under a millisecond
                reply = client.lookup_now(hashes, pin=True, lease_ms=self.lease_ms, timeout_s=CALL_TIMEOUT_S)
            else:
                lease_ms = self.lease_ms
                reply = await client.lookup(hashes, pin=True, lease_ms=lease_ms, timeout_s=CALL_TIMEOUT_S)
        except KvpathError as exc:
            metrics.POOL_BLOCKS.labels("error").inc(num_blocks)
            log.warning("pool lookup failed request_id=%s: %s", seq.request_id, exc.message)
            return None
        slots = reply.slots
        good = len(slots)
        if self.verify_checksums and slots:
            good = self.verified.verified_prefix(self.memory, slots, reply.checksums, reply.generations)
        metrics.POOL_BLOCKS.labels("hit").inc(good)
        metrics.POOL_BLOCKS.labels("miss").inc(num_blocks - good)
        if good < len(slots):
            metrics.POOL_BLOCKS.labels("corrupt").inc(1)
            log.warning("pool block %d of request_id=%s is corrupt: a miss from there", good, seq.request_id)
        if not good:
            self._unpin(reply.lease_id)
            return None
        return PoolRead(reply.lease_id, slots[:good], self._runs(slots[:good]))

    def _runs(self, slots: list[int]) -> list[tuple[int, int, np.ndarray]]:
        shape = self.layout.shape
        out = []
        for first, count, device, row in self.memory.runs(slots):
            flat = self.memory.devices[device][row : row + count]
            out.append((first, count, flat.reshape(count, *shape)))
        return out

    def import_layer(self, block_ids: list[int], read: PoolRead, layer: int) -> None:
        """Layer `layer` of the leased blocks into the cache blocks `block_ids` (CUDA: one kernel launch
        reading the mapped pool; else one copy per run of slots)."""
        if self._copier is not None:
            if read.gather is None:
                read.gather = self._copier.prepare(
                    self._device_ptrs(read.slots), block_ids[: read.num_blocks]
                )
            self._copier.gather_layer(read.gather, layer)
            return
        for first, count, blocks in read.runs:
            self.kv.import_layer(block_ids[first : first + count], layer, blocks[:, layer])

    def import_blocks(self, block_ids: list[int], read: PoolRead) -> None:
        """Every layer of the leased blocks into the cache blocks `block_ids` (one copy per run)."""
        for first, count, blocks in read.runs:
            self.kv.import_blocks(block_ids[first : first + count], blocks)

    def release(self, read: PoolRead) -> None:
        """End the read's lease (in the background; an expired lease ends by itself)."""
        self._unpin(read.lease_id)

    def _unpin(self, lease_id: int) -> None:
        if lease_id:
            self._keep(self._unpin_quietly(lease_id))

    async def _unpin_quietly(self, lease_id: int) -> None:
        try:
            await self.client.unpin(lease_id, timeout_s=CALL_TIMEOUT_S)
        except KvpathError as exc:  # the lease expires by itself
            log.debug("pool unpin failed lease=%d: %s", lease_id, exc.message)

    # ----------------------------------------------------------------------------------------- write

    def write(self, seq: Sequence, start: int, end: int, parent: int) -> Awaitable[None] | None:
        """Write blocks [start, end) of the sequence (full, hashed) into the pool; the awaitable ends once
        they are committed (None: nothing to wait for). The cache blocks are copied before this returns."""
        if end <= start or not self.client.is_local:
            return None
        hashes = seq.block_hashes[start:end]
        parents = [parent, *hashes[:-1]]
        started = time.perf_counter()
        try:
            slots = self.client.alloc_now(hashes, parents, lease_ms=self.lease_ms, timeout_s=CALL_TIMEOUT_S)
        except KvpathError as exc:
            metrics.POOL_BLOCKS.labels("write_error").inc(end - start)
            log.warning("pool alloc failed request_id=%s: %s", seq.request_id, exc.message)
            return None
        picked = [i for i, s in enumerate(slots) if s >= 0]
        if not picked:
            return None
        block_ids = [seq.block_ids[start + i] for i in picked]
        targets = [int(slots[i]) for i in picked]
        checksums = self._export(block_ids, targets)
        metrics.POOL_BLOCKS.labels("written").inc(len(picked))
        metrics.POOL_WRITE_SECONDS.observe(time.perf_counter() - started)
        return self._keep(self._commit(seq.request_id, [hashes[i] for i in picked], targets, checksums))

    def _export(self, block_ids: list[int], slots: list[int]) -> list[int]:
        if self._copier is not None:  # one launch writes every block into its mapped slot
            self._copier.scatter_blocks(block_ids, self._device_ptrs(slots))
            return [block_checksum(self.memory.slot(slot)) for slot in slots]
        checksums = []
        for first, count, blocks in self._runs(slots):
            self.kv.export_blocks(block_ids[first : first + count], blocks)
            checksums += [block_checksum(b) for b in blocks]
        return checksums

    def _device_ptrs(self, slots: list[int]) -> list[int]:
        """The device addresses of the slots in the registered pool memory."""
        devices, rows = self.memory.geometry.locate_many(np.asarray(slots, dtype=np.int64))
        bases = np.asarray(self._registered.device_ptrs, dtype=np.uint64)[devices]
        return (bases + rows.astype(np.uint64) * np.uint64(self.memory.geometry.slot_bytes)).tolist()

    async def _commit(
        self, request_id: str, hashes: list[int], slots: list[int], checksums: list[int]
    ) -> None:
        try:
            generations = await self.client.commit(hashes, checksums, timeout_s=1.0)
        except KvpathError as exc:  # uncommitted slots go back when their allocation expires
            metrics.POOL_BLOCKS.labels("write_error").inc(len(hashes))
            log.warning("pool commit failed request_id=%s: %s", request_id, exc.message)
            return
        self.verified.mark(slots, checksums, generations)  # hashed from the slots: no need to again

    def _keep(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        return self._background.keep(work)

    async def close(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.stop()  # before the mapping goes
        await self._background.close(grace_s=1.0)
        if self._registered is not None:
            self._registered.close()
        self.client.close()

"""A stored prefix loaded from the tiers an engine has, and finished blocks saved to the upper one: what the
colocated, prefill and session connectors share (`TieredPrefix`, one per connector).

Tiers, fastest first: an upper tier when the engine has one (`KvTier`: the Beluga pool, `pool_tier.py`, or
the remote-memory baseline, `remote_tier.py`), then the node's storage service. A read asks the upper tier
for the longest prefix it holds and storage for the blocks after it, up to the hit the router planned; the
blocks are copied into the paged cache by `TieredLoadHook` (layer l right before layer l computes on a GPU,
every layer before the forward on the CPU) and the leases end once they are there. A save writes the blocks
that filled since the last save into the upper tier. A missing, corrupt or unreachable tier is a miss or a
skipped write, counted by reason (by the tier), never a failed request. A sequence preempted while running
(the cache full) is read again (`reread`): what it had loaded and what it persisted since, so only the rest
is recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

from gpu.runner import LayerHook, PrefillSeq
from services.engine.node_storage import NodeStorage
from services.engine.persist import PersistChain, extend_hashes, root_of
from services.engine.sequence import Sequence
from shared.blocks import max_hit_blocks
from shared.kvclient import ReadLease


class TierRead(Protocol):
    """Blocks an upper tier holds for one sequence (a lease on them), until they are in the cache."""

    @property
    def num_blocks(self) -> int: ...


class KvTier(Protocol):
    """A KV tier above storage, engine side. Called on the event loop; `read`/`write` may do I/O but never
    block the loop for long; failures are misses (None) or skipped writes, never exceptions."""

    async def read(self, seq: Sequence, num_blocks: int) -> TierRead | None:
        """Lease the longest prefix of the sequence's first `num_blocks` blocks the tier holds."""

    def import_layer(self, block_ids: list[int], read: Any, layer: int) -> None:
        """Copy layer `layer` of the leased blocks into cache blocks `block_ids`."""

    def import_blocks(self, block_ids: list[int], read: Any) -> None:
        """Copy the leased blocks, every layer, into cache blocks `block_ids`."""

    def release(self, read: Any) -> None:
        """End the lease (the blocks are in the cache, or the sequence left)."""

    def write(self, seq: Sequence, start: int, end: int, parent: int) -> Awaitable[None] | None:
        """Copy the sequence's full, hashed blocks [start, end) out of the cache now and store them; the
        awaitable ends once they are published (None: nothing to wait for)."""

    async def close(self) -> None: ...


@dataclass(slots=True)
class PrefixRead:
    """A sequence's leading blocks leased for loading: the upper tier's part, then storage's after it."""

    tier_read: Any = None  # a TierRead, until it is in the cache
    lease: ReadLease | None = None

    @property
    def num_tier_blocks(self) -> int:
        return self.tier_read.num_blocks if self.tier_read is not None else 0

    @property
    def num_blocks(self) -> int:
        return self.num_tier_blocks + (self.lease.num_blocks if self.lease is not None else 0)


class TieredPrefix:
    """Owns the upper tier (closes it); borrows the connector's storage link."""

    def __init__(self, kv: Any, tier: KvTier | None, storage: NodeStorage, block_size: int) -> None:
        self.kv = kv
        self.tier = tier
        self.storage = storage
        self.block_size = block_size

    async def close(self) -> None:
        if self.tier is not None:
            await self.tier.close()

    async def read(self, seq: Sequence, *, tier_blocks: int, stored_blocks: int) -> PrefixRead:
        """Lease the longest prefix of the first `tier_blocks` blocks the upper tier holds (0: skip it), then
        storage's blocks after it up to `stored_blocks` (the router's hit)."""
        read = PrefixRead()
        if self.tier is not None and tier_blocks > 0:
            read.tier_read = await self.tier.read(seq, tier_blocks)
        read.lease = await self.storage.read_blocks(seq, read.num_tier_blocks, stored_blocks)
        return read

    async def reread(self, seq: Sequence, chain: PersistChain, *, hit_blocks: int = 0) -> PrefixRead:
        """A preempted sequence's stored leading blocks: its first `hit_blocks` and those its `chain` wrote
        (once those writes ended, within their bound; not those of a write still on its way or failed,
        which the store does not have), its generated tokens' too, all but the block of the last token it
        recomputes; the upper tier first as in `read`."""
        await self.storage.persister.wait_written(chain, seq.deadline_unix_s)
        usable = min(len(seq.block_hashes), max_hit_blocks(seq.prefill_target, self.block_size))
        stored = min(max(hit_blocks, chain.num_written_blocks()), usable)
        return await self.read(seq, tier_blocks=usable, stored_blocks=stored)

    def import_into(self, block_ids: list[int], read: PrefixRead, layer: int | None) -> None:
        """Layer `layer` (None: every layer) of the leased blocks into the cache blocks `block_ids`."""
        tiered = read.num_tier_blocks
        if read.tier_read is not None and self.tier is not None:
            if layer is None:
                self.tier.import_blocks(block_ids, read.tier_read)
            else:
                self.tier.import_layer(block_ids, read.tier_read, layer)
        if read.lease is not None:
            ids = block_ids[tiered:]
            if layer is None:
                self.kv.import_blocks(ids, read.lease.views[: len(ids)])
            else:
                self.kv.import_layer(ids, layer, read.lease.layer(layer)[: len(ids)])

    def release(self, read: PrefixRead | None) -> None:
        """End the read's leases (the blocks are in the cache, or the sequence left)."""
        if read is None:
            return
        tier_read, read.tier_read = read.tier_read, None
        if tier_read is not None and self.tier is not None:
            self.tier.release(tier_read)
        lease, read.lease = read.lease, None
        self.storage.release(lease)

    def save(self, seq: Sequence, num_saved_blocks: int) -> tuple[int, Awaitable[None] | None]:
        """Write the sequence's blocks that filled since `num_saved_blocks` into the upper tier: the blocks
        saved now, and what to await for them to be published (None: nothing)."""
        full = seq.num_computed_tokens // self.block_size
        if self.tier is None or full <= num_saved_blocks:
            return num_saved_blocks, None
        seed = self.storage.persister.seed
        hashes = extend_hashes(seq, full, seed, self.block_size)
        parent = hashes[num_saved_blocks - 1] if num_saved_blocks else root_of(seq, seed)
        return full, self.tier.write(seq, num_saved_blocks, full, parent)


class TieredLoadHook(LayerHook):
    """Copies each load (sequence, its read, blocks loaded) into the cache: on a GPU layer l right before
    layer l computes (the copies overlap the compute of the layers before); on the CPU, where nothing
    overlaps, every layer before the forward, in the model's worker thread (one thread hop for the whole
    prefill), one copy per run of whole blocks. The time spent copying is the request's `import_s`."""

    def __init__(self, prefix: TieredPrefix, loads: list[tuple[Sequence, PrefixRead, int]]) -> None:
        self.prefix = prefix
        self.loads = loads
        self.is_layerwise = prefix.kv.device != "cpu"

    async def before_layer(self, layer: int, seqs: Seq[PrefillSeq]) -> None:
        if self.is_layerwise:
            self.import_layer(layer)
        elif layer == 0:  # composed with layerwise hooks (route.py): everything before layer 0
            self.import_layer(None)

    def before_forward(self, seqs: Seq[PrefillSeq]) -> None:
        self.import_layer(None)

    def import_layer(self, layer: int | None) -> None:
        """Layer `layer` of every load (None: every layer)."""
        for seq, read, n in self.loads:
            started = time.perf_counter()
            self.prefix.import_into(seq.block_ids[:n], read, layer)
            seq.timings["import_s"] = seq.timings.get("import_s", 0.0) + time.perf_counter() - started

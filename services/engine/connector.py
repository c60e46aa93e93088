"""The seam between an engine and KV that lives outside it (storage, other engines).

The engine core calls a connector at four points of a request's life; implementations move the bytes
(`storage_connector.py`: the block store; the DualPath connectors: the PE/DE data plane). `NullConnector` is
the reference implementation: no external KV, everything is recomputed and nothing is persisted.

Ownership: the connector owns whatever it reads (buffer leases) until `release`; the engine owns the
sequence's cache blocks and never frees them while a connector call that reads them is in progress.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Sequence as Seq

from gpu.runner import LayerHook
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared.errors import KvpathError


class KvConnector:
    async def start(self) -> None:
        """Open connections and buffers. Called once before the first request."""

    async def close(self) -> None:
        """Release everything. Called once on engine stop, after the last step."""

    async def prepare(self, seq: Sequence) -> None:
        """Before the sequence is scheduled: fetch its stored prefix (if any) and set `seq.num_hit_tokens`.

        Called once per request, concurrently with engine steps; must not raise for a missing or corrupt
        prefix (that is a miss: leave num_hit_tokens at 0 or shorter) and must respect `seq.deadline_unix_s`.
        """

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        """A hook supplying the loaded prefix layer by layer for this step; None if nothing to load."""
        return None

    def after_step(self, seqs: Seq[Sequence]) -> None:
        """After a step changed these sequences' caches: persist blocks that became full.

        Runs on the event loop between steps, so the blocks are stable; it may copy out of the cache
        synchronously and must hand any slow I/O to a task of its own.
        """

    def import_only(self, chunks: Seq[PrefillChunk]) -> None:
        """Copy the KV of prompts prefilled elsewhere (load-only chunks) into the cache. Decode engines."""
        raise NotImplementedError(f"{type(self).__name__} cannot take over prefilled prompts")

    def failures(self) -> dict[str, KvpathError]:
        """Requests whose external KV failed during the last step (they end with that error)."""
        return {}

    def release(self, seq: Sequence) -> None:
        """The sequence finished, failed or was preempted: drop what is held for it (read leases)."""

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        """The sequence finished (`seq.finish_reason` is set; its blocks are still allocated and may be
        copied out synchronously here). Return an awaitable if its last delta must wait for it (e.g. until
        its blocks are durable), else None. Either way the connector forgets the sequence afterwards."""
        return None

    def stats(self) -> dict[str, float]:
        return {}


class NullConnector(KvConnector):
    """No external KV: every prompt token is computed, nothing persists."""

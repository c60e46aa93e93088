"""The seam between an engine and the KV that lives outside it (storage, other engines).

One connector per role, each a complete implementation of the hooks below (no role inherits another's):
`NullConnector` (this file: the reference; no external KV, everything recomputed, nothing persisted),
`ColocatedConnector` (the node's block store), `PrefillConnector` and `DecodeConnector` (DualPath's PE and
DE over the KV data plane). The engine core calls the hooks at fixed points of a request's life:

  accept      on admission, with the task: take the role's part of it (reserve buffers; a DE names the
              buffer its PE streams into), or refuse by raising
  load        before the request is scheduled: fetch its stored prefix (a DE: wait for its PE's stream)
  layer_hook  per prefill step: supply loaded KV layer by layer, stream computed layers out
  import_prefilled  a DE's load-only chunk: copy a prompt prefilled elsewhere into the cache
  save        after every step: persist blocks that filled
  failure     after a step: the request's external KV failed (it ends with that error)
  finish      the request is done: what its last token delta must wait for (blocks durable, DONE notice)
  release     the request left (finished, failed, preempted): drop what is held for it
  fork        a choice of a request with n > 1 took over the cache blocks of its prompt (choices.py)
  serve_pull  another engine asks for a stored prefix this one read (a DE on the DE read path)

Ownership: a connector keeps its per-request record in `seq.kv_state` (no maps of its own keyed by request
id); it owns what it reads (buffer leases, extents) until `release`; the engine owns the cache blocks and
never frees them while a connector call that reads them is in progress.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable
from collections.abc import Sequence as Seq
from typing import Any

from gpu.runner import LayerHook
from services.engine.scheduler import PrefillChunk
from services.engine.sequence import Sequence
from shared.errors import InvalidRequestError, KvpathError
from shared.protocol import RouteCapability
from shared.protocol.tasks import BufferRef, GenerateTask, PullHits, PullHitsReply, Task


class KvConnector(abc.ABC):
    # the task kind(s) an engine with this connector takes
    task_type: type[Task] | tuple[type[Task], ...] = GenerateTask
    serves_pulls = False  # whether `serve_pull` answers (the engine then subscribes to pulls)
    supports_choices = False  # whether tasks with n > 1 are taken (else refused)
    forks_choices = True  # with supports_choices: this engine forks them (a PE serves choice 0, its DE forks)
    # a preempted sequence is loaded again (`load` once more) before it recomputes what is not stored
    reloads_preempted = False

    async def start(self) -> None:  # noqa: B027 (optional hook)
        """Open connections and buffers. Called once before the first request."""

    async def close(self) -> None:  # noqa: B027
        """Release everything. Called once on engine stop, after the last step."""

    def block_allocator(self, kv: Any) -> Any:
        """The block allocator the scheduler uses over the paged cache `kv` (once, when the engine core is
        built): the cache itself, or a wrapper (a session engine's evicts idle sessions' resident KV)."""
        return kv

    def accept(self, seq: Sequence, task: Task) -> BufferRef | None:
        """Take the role's part of `task` on admission (before `load`); the buffer a peer must write into,
        if any, goes back in the ack. Raise a KvpathError (e.g. OverloadedError) to refuse the task."""
        return None

    @abc.abstractmethod
    async def load(self, seq: Sequence) -> None:
        """Before the sequence is scheduled: fetch its stored prefix and set `seq.num_hit_tokens`.

        Called once per request (and after each preemption with `reloads_preempted`: the blocks stored
        since count then), concurrently with engine steps; a missing or corrupt prefix is a miss
        (num_hit_tokens stays 0 or shorter), never an error; must respect `seq.deadline_unix_s`."""

    @abc.abstractmethod
    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        """The hook for this prefill step (loaded prefix in, computed layers out); None: nothing to do."""

    def import_prefilled(self, chunks: Seq[PrefillChunk]) -> None:
        """Copy the KV of prompts prefilled elsewhere (load-only chunks) into the cache."""
        raise InvalidRequestError(f"{type(self).__name__} cannot take over prefilled prompts")

    @abc.abstractmethod
    def save(self, seqs: Seq[Sequence]) -> None:
        """After a step changed these sequences' caches: persist the blocks that became full.

        Runs on the event loop between steps, so the blocks are stable; it may copy out of the cache
        synchronously and must hand any slow I/O to a task of its own."""

    def failure(self, seq: Sequence) -> KvpathError | None:
        """The error the sequence's external KV hit during the last step, if any (it then fails)."""
        return None

    def finish(self, seq: Sequence) -> Awaitable[None] | None:
        """The sequence finished (`seq.finish_reason` is set; its blocks are still allocated and may be
        copied out synchronously here). Return an awaitable if its last delta must wait for it, else None.
        Either way the connector is done with the sequence's record afterwards (`release` follows)."""
        return None

    def attention_prefix(self, seq: Sequence) -> Any:
        """Where attention over the sequence's leading context comes from when that context is not in this
        cache (a routed chunk: `gpu.partial_attention_remote.ChunkExchange`), for each step it is in; None:
        everything it attends is in the cache (every connector but `services/engine/route.py`)."""
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a choice of `parent`'s request, never accepted or loaded) now shares `parent`'s prompt
        blocks: set up its record as if it had computed them (nothing left to load or persist for them).
        Called on the event loop between steps, once per choice, only when `supports_choices`."""
        raise InvalidRequestError(f"{type(self).__name__} does not fork choices")

    def release(self, seq: Sequence) -> None:  # noqa: B027
        """The sequence finished, failed or was preempted: drop what is held for it (read leases)."""

    async def serve_pull(self, seq: Sequence, msg: PullHits) -> PullHitsReply:
        """Stream the stored prefix this engine read for `seq` to the asking engine (DE read path)."""
        raise InvalidRequestError(f"engine does not serve prefix pulls ({type(self).__name__})")

    def stats(self) -> dict[str, float]:
        return {}

    def pinned_blocks(self) -> int:
        """Cache blocks this connector keeps out of the requests' reach (a holder's chunks): admission
        refuses a request that would not fit beside them, so another engine takes it."""
        return 0

    def route_capability(self) -> RouteCapability | None:
        """What the load report says of move-the-query's route protocol (None: this engine does not speak
        it)."""
        return None


class NullConnector(KvConnector):
    """No external KV: every prompt token is computed, nothing persists."""

    supports_choices = True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.kv_state = None

    async def load(self, seq: Sequence) -> None:
        return None

    def layer_hook(self, chunks: Seq[PrefillChunk]) -> LayerHook | None:
        return None

    def save(self, seqs: Seq[Sequence]) -> None:
        return None

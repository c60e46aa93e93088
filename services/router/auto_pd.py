"""`--policy auto` on prefill/decode engines: the plan auto's cost model chose, executed with the P/D sends.

What the topology offers depends on its decode engines (`--auto-decode-engines`):
  session   (`--session-kv`, what `kvpath up --policy auto --prefill-nodes N --decode-nodes M` starts by
            default, AMPD's decode workers) prefill locally from the session's resident KV (`local/hbm`),
            from storage on their node (`local/storage`) or from nothing (`local/recompute`); remotely (a PE
            prefills) the history is streamed from the decode engine's cache (`remote/hbm`, read side
            `hbm`), read on the PE's node (`remote/storage`, read side `pe`), or recomputed
            (`remote/recompute`);
  dualpath  (DualPath's decode engines, `kvpath up ... --auto-decode-engines dualpath`) only decode: a PE
            prefills, reading the stored prefix on its own node (`remote/storage`) or on the decode engine's
            (`remote/storage-de`, read side `de`: the decode engine reads it and streams it over), or
            recomputing it.
With a KV pool (`kvpath up ... --kv-tier pool`: prefill and session decode engines map it) the engine that
prefills reads the prefix from the pool, storage below it (`remote/pool` on a PE, `local/pool` on a session
decode engine; read side `pool`); the pool is offered when the index places the prompt's prefix in one
(`cxl:<pool>`), as on colocated engines. `PD_PATHS` says so to the model (`AutoSnapshot.sources`,
`local_on_decode`), so a path the topology does not offer is never chosen. A send that fails leaves out of the
next decision only the engine at fault (up to MAX_DISPATCH_ATTEMPTS): a decode engine that refuses or cannot
be reached, or a PE that fails after its decode engine took the turn (that turn is aborted); the request goes
to another pair or prefills locally on the same decode engine, under a retry's own id (`attempt_request_id`),
so the abort never meets it. A dead PE is out of every plan once its load reports stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

from services.policy.auto import LOCAL, Decision, Plan, Source
from services.policy.snapshot import ROLE_DECODE, ROLE_PREFILL, EngineSnapshot
from services.router import metrics
from services.router.dispatch import (
    MAX_DISPATCH_ATTEMPTS,
    Dispatch,
    attempt_request_id,
    publish_abort,
    undispatched,
)
from services.router.engines import EngineTable
from services.router.pd_tasks import pooled_blocks, prefill_turn, send_local, stored_blocks, take_turn
from services.router.streams import StreamTable
from shared.blocks import max_hit_blocks
from shared.errors import (
    DeadlineExceededError,
    EngineFailedError,
    KvpathError,
    OverloadedError,
    ServiceUnavailableError,
)
from shared.protocol import KvPlan, RequestPlan

log = logging.getLogger(__name__)

SESSION_DECODE = "session"
DUALPATH_DECODE = "dualpath"
# decode engines -> (the hit sources the topology offers, whether a decode engine prefills locally)
PD_PATHS: dict[str, tuple[frozenset[Source], bool]] = {
    SESSION_DECODE: (frozenset({Source.HBM, Source.POOL, Source.STORAGE, Source.RECOMPUTE}), True),
    DUALPATH_DECODE: (frozenset({Source.POOL, Source.STORAGE, Source.STORAGE_DE, Source.RECOMPUTE}), False),
}
PD_ROLES = (ROLE_PREFILL, ROLE_DECODE)
Decide = Callable[[list[EngineSnapshot], RequestPlan, Mapping[str, int]], Decision | None]
RETRIED = (ServiceUnavailableError, DeadlineExceededError, OverloadedError, EngineFailedError)


def has_pd_engines(engines: EngineTable) -> bool:
    """Whether prefill/decode engines serve (else the colocated engines do)."""
    return bool(engines.live(time.monotonic(), roles=PD_ROLES))


@dataclass(slots=True)
class SentPlan:
    timings: dict[str, float]  # the router's stage timings
    decision: Decision  # the one that was sent
    task_id: str  # the id the engines know the request by (a retry's own: `attempt_request_id`)


class EngineFault(Exception):
    """A send failed at one engine, with an error worth another decision without it."""

    def __init__(self, engine_id: str, error: KvpathError, *, receiving: bool = False) -> None:
        super().__init__(error.message)
        self.engine_id, self.error = engine_id, error
        self.receiving = receiving  # the decode engine refused to receive a remote prefill

    @property
    def is_gone(self) -> bool:
        """No service answers for the engine (its own send, or the PE behind a hand-off, `prefill_turn`)."""
        return isinstance(self.error, ServiceUnavailableError) or isinstance(
            self.error.__cause__, ServiceUnavailableError
        )

    @property
    def has_no_room_to_receive(self) -> bool:
        """The decode engine had no room for a remote turn's KV (DE buffer or queue full; it reserved
        nothing): it may still prefill the turn itself."""
        return self.receiving and isinstance(self.error, OverloadedError)


async def dispatch_pd(
    auto: Dispatch,
    decide: Decide,
    plan: RequestPlan,
    deadline: float,
    streams: StreamTable,
    locality: Mapping[str, int],
) -> SentPlan:
    """Decide among the P/D plans, send the chosen one; on a refusal or a failed engine, abort that attempt
    and decide again without the engine at fault (`decide`: auto's plan over the engines given,
    `AutoDispatch.decide`). Each retry goes under its own id, so the abort never meets it."""
    block_size = _block_size(auto)
    stored = stored_blocks(plan, locality, block_size)
    pooled = pooled_blocks(plan, locality, block_size)
    tried: set[str] = set()
    roles: tuple[str, ...] = PD_ROLES
    error: KvpathError | None = None
    for attempt in range(MAX_DISPATCH_ATTEMPTS):
        task = replace(plan, request_id=attempt_request_id(plan.request_id, attempt))
        engines = [e for e in auto.engines.engine_snapshots(block_size, roles) if e.engine_id not in tried]
        decision = decide(engines, task, locality)
        if decision is None:
            break
        if attempt:
            streams.retarget(plan.request_id, task.request_id)
        chosen = decision.chosen
        streams.assign(plan.request_id, chosen.decode_engine)
        try:
            timings = await _send(auto, task, chosen, stored, deadline, streams, pooled=pooled)
        except EngineFault as fault:
            for engine_id in {chosen.decode_engine, chosen.prefill_engine}:
                streams.unassign(plan.request_id, engine_id)
            log.warning(
                "auto plan failed request_id=%s plan=%s engine=%s: %s",
                plan.request_id,
                chosen.label,
                fault.engine_id,
                fault.error.message,
            )
            await publish_abort(auto.bus, task.request_id, "dispatch failed")
            if fault.is_gone and auto.engines.suspect(fault.engine_id):
                metrics.ENGINES_SUSPECTED.inc()  # no service answers for it: out until it reports again
            if fault.has_no_room_to_receive:  # decide again among local plans (their predictions recorded)
                roles = (ROLE_DECODE,)
                metrics.DECODE_REFUSED.inc()
            else:
                tried.add(fault.engine_id)
            error = fault.error
            continue
        return SentPlan(timings, decision, task.request_id)
    raise undispatched(error, deadline, "prefill/decode engine")


async def _send(
    auto: Dispatch,
    plan: RequestPlan,
    chosen: Plan,
    stored: int,
    deadline: float,
    streams: StreamTable,
    *,
    pooled: int = 0,
) -> dict[str, float]:
    """Execute the plan: a local prefill on the decode engine, or a remote one with the history's source
    (`stored`, `pooled`: the prompt's leading blocks in storage and in the pool)."""
    pe, de, kv = chosen.prefill_engine, chosen.decode_engine, plan.kv
    if chosen.where == LOCAL:  # the engine takes its resident KV by itself; storage or the pool when planned
        local = tier_plan(kv, chosen.source, stored, pooled)
        with _at_fault(de):
            return await send_local(auto, plan, de, local.num_hit_blocks, deadline, read_side=local.read_side)
    usable = max_hit_blocks(plan.num_prompt_tokens, _block_size(auto))
    history = partial(remote_history, kv, chosen.source, stored, usable, pooled=pooled)
    # storage-de: the decode engine reads, from the moment it takes the turn
    de_kv = history(0) if chosen.source is Source.STORAGE_DE else None
    placed = time.monotonic()
    with _at_fault(de, receiving=True):
        buffer = await take_turn(auto, plan, (pe, de), deadline, de_kv=de_kv)
    with _at_fault(pe):
        return await prefill_turn(auto, plan, (pe, de), buffer, history, deadline, streams, placed=placed)


@contextmanager
def _at_fault(engine_id: str, *, receiving: bool = False) -> Iterator[None]:
    """Name the engine behind an error that another decision, without that engine, may get around."""
    try:
        yield
    except RETRIED as exc:
        raise EngineFault(engine_id, exc, receiving=receiving) from exc


def tier_plan(kv: KvPlan, source: Source, stored: int, pooled: int) -> KvPlan:
    """What the engine that prefills loads from below its cache (`kv`: the request's plan): the pool's prefix
    with storage below it (read side `pool`, hits up to the longer of the two), the stored prefix, or
    nothing."""
    if source is Source.POOL and pooled > 0:
        return kv.with_hits(max(pooled, stored), "pool")
    if source is Source.STORAGE and stored > 0:
        return kv.with_hits(stored)
    return kv.with_hits()


def remote_history(
    kv: KvPlan, source: Source, stored: int, usable: int, kept_blocks: int, *, pooled: int = 0
) -> KvPlan:
    """The PE's KV plan once the decode engine named the blocks it kept: those (`hbm`), the pool's prefix
    (`pool`, storage below it), the stored prefix read on the PE's node (`pe`: planned, or `hbm` planned but
    nothing kept) or on the DE's (`de`: the DE had it from the start), or none."""
    if source is Source.STORAGE_DE:
        return kv.with_hits(stored, "de")
    kept = min(kept_blocks, usable)
    if source is Source.HBM and kept > 0:
        return kv.with_hits(kept, "hbm")
    if source is Source.POOL and pooled > 0:
        return tier_plan(kv, source, stored, pooled)
    if source in (Source.HBM, Source.STORAGE, Source.POOL) and stored > 0:
        return kv.with_hits(stored, "pe")
    return kv.with_hits()


def _block_size(dispatch: Dispatch) -> int:
    kv_format = dispatch.engines.kv_format
    return kv_format.block_size if kv_format is not None else 1

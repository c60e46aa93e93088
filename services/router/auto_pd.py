"""`--policy auto` on prefill/decode engines: the plan auto's cost model chose, executed with the P/D sends.

What the topology offers depends on its decode engines (`--auto-decode-engines`):
  session   (`--session-kv`, what `kvpath up --policy auto --prefill-nodes N --decode-nodes M` starts, AMPD's
            decode workers) prefill locally from the session's resident KV (`local/hbm`), from storage on
            their node (`local/storage`) or from nothing (`local/recompute`); remotely (a PE prefills) the
            history is streamed from the decode engine's cache (`remote/hbm`, read side `hbm`), read on the
            PE's node (`remote/storage`, read side `pe`), or recomputed (`remote/recompute`);
  dualpath  (DualPath's decode engines) only decode: a PE prefills, reading the stored prefix on its own node
            (`remote/storage`) or on the decode engine's (`remote/storage-de`, read side `de`: the decode
            engine reads it and streams it over), or recomputing it.
`PD_PATHS` says so to the model (`AutoSnapshot.sources`, `local_on_decode`), so a path the topology does not
offer is never chosen. A decode engine that refuses or cannot be reached, and a PE that fails after its
decode engine took the turn, are left out of the next decision (up to MAX_DISPATCH_ATTEMPTS): the request
goes to another pair or prefills locally, and a dead PE is out of every plan once its load reports stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from functools import partial

from services.policy.auto import LOCAL, Decision, Plan, Source
from services.policy.snapshot import ROLE_DECODE, ROLE_PREFILL, EngineSnapshot
from services.router.dispatch import MAX_DISPATCH_ATTEMPTS, Dispatch, publish_abort
from services.router.engines import EngineTable
from services.router.pd_tasks import send_local, send_remote, stored_blocks
from services.router.streams import StreamTable
from shared.blocks import max_hit_blocks
from shared.errors import (
    DeadlineExceededError,
    EngineFailedError,
    KvpathError,
    NoEngineAvailableError,
    OverloadedError,
    ServiceUnavailableError,
)
from shared.protocol import KvPlan, RequestPlan

log = logging.getLogger(__name__)

SESSION_DECODE = "session"
DUALPATH_DECODE = "dualpath"
# decode engines -> (the hit sources the topology offers, whether a decode engine prefills locally)
PD_PATHS: dict[str, tuple[frozenset[Source], bool]] = {
    SESSION_DECODE: (frozenset({Source.HBM, Source.STORAGE, Source.RECOMPUTE}), True),
    DUALPATH_DECODE: (frozenset({Source.STORAGE, Source.STORAGE_DE, Source.RECOMPUTE}), False),
}
PD_ROLES = (ROLE_PREFILL, ROLE_DECODE)
Decide = Callable[[list[EngineSnapshot], RequestPlan, Mapping[str, int]], Decision | None]
RETRIED = (ServiceUnavailableError, DeadlineExceededError, OverloadedError, EngineFailedError)


def has_pd_engines(engines: EngineTable) -> bool:
    """Whether prefill/decode engines serve (else the colocated engines do)."""
    return bool(engines.live(time.monotonic(), roles=PD_ROLES))


async def dispatch_pd(
    auto: Dispatch,
    decide: Decide,
    plan: RequestPlan,
    deadline: float,
    streams: StreamTable,
    locality: Mapping[str, int],
) -> tuple[dict[str, float], Decision]:
    """Decide among the P/D plans, send the chosen one; on a refusal or a failed PE, decide again without
    the engines that failed (`decide`: auto's plan over the engines given, `AutoDispatch.decide`). Return the
    router's stage timings and the decision that was sent."""
    block_size = _block_size(auto)
    stored = stored_blocks(plan, locality, block_size)
    kv = plan.kv  # the sends rewrite it; every decision starts from the index's answer
    tried: set[str] = set()
    error: KvpathError | None = None
    for _ in range(MAX_DISPATCH_ATTEMPTS):
        plan.kv = kv
        engines = [e for e in auto.engines.engine_snapshots(block_size, PD_ROLES) if e.engine_id not in tried]
        decision = decide(engines, plan, locality)
        if decision is None:
            break
        chosen = decision.chosen
        streams.assign(plan.request_id, chosen.decode_engine)
        try:
            timings = await _send(auto, plan, chosen, stored, deadline, streams)
        except RETRIED as exc:
            for engine_id in {chosen.decode_engine, chosen.prefill_engine}:
                streams.unassign(plan.request_id, engine_id)
            log.warning("auto plan failed request_id=%s plan=%s: %s", plan.request_id, chosen.label, exc)
            await publish_abort(auto.bus, plan.request_id, "dispatch failed")
            tried |= {chosen.decode_engine, chosen.prefill_engine}  # a same-id retry could meet the abort
            error = exc
            continue
        return timings, decision
    if isinstance(error, OverloadedError):
        raise error
    raise NoEngineAvailableError(
        "no prefill/decode engine is available" + (f" (last error: {error.message})" if error else "")
    )


async def _send(
    auto: Dispatch, plan: RequestPlan, chosen: Plan, stored: int, deadline: float, streams: StreamTable
) -> dict[str, float]:
    """Execute the plan: a local prefill on the decode engine, or a remote one with the history's source."""
    de, hashes = chosen.decode_engine, plan.kv.block_hashes
    if chosen.where == LOCAL:  # the engine takes its resident KV by itself; storage only when planned
        return await send_local(auto, plan, de, stored if chosen.source is Source.STORAGE else 0, deadline)
    pair = (chosen.prefill_engine, de)
    if chosen.source is Source.STORAGE_DE:  # the decode engine reads, from the moment it takes the turn
        read = KvPlan(block_hashes=hashes, num_hit_blocks=stored, read_side="de")
        return await send_remote(auto, plan, pair, lambda _: read, deadline, streams, de_kv=read)
    usable = max_hit_blocks(plan.num_prompt_tokens, _block_size(auto))
    history = partial(remote_history, hashes, chosen.source, stored, usable)
    return await send_remote(auto, plan, pair, history, deadline, streams)


def remote_history(hashes: list[int], source: Source, stored: int, usable: int, kept_blocks: int) -> KvPlan:
    """The PE's KV plan once the decode engine named the blocks it kept: those (`hbm`), the stored prefix
    read on the PE's node (`pe`: planned, or `hbm` planned but nothing kept), or none."""
    kept = min(kept_blocks, usable)
    if source is Source.HBM and kept > 0:
        return KvPlan(block_hashes=hashes, num_hit_blocks=kept, read_side="hbm")
    if source in (Source.HBM, Source.STORAGE) and stored > 0:
        return KvPlan(block_hashes=hashes, num_hit_blocks=stored, read_side="pe")
    return KvPlan(block_hashes=hashes)


def _block_size(dispatch: Dispatch) -> int:
    kv_format = dispatch.engines.kv_format
    return kv_format.block_size if kv_format is not None else 1

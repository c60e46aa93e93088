"""The task sends of a prefill/decode pair, shared by the dispatches that run one (AMPD's `SessionDispatch`,
`--policy auto` on P/D engines, DualPath's `DisaggregatedDispatch`).

Local: the decode engine prefills the turn itself (a `GenerateTask` to a session engine, which takes its
resident KV or loads its stored prefix). Remote: a `DecodeTask` to the decode engine first (it reserves the
buffer the prefill engine writes into, keeps the resident blocks the prompt still starts with and names them
in `BufferRef.num_kept_blocks`), then a `PrefillTask` to the prefill engine whose `KvPlan` says where the
history comes from, decided once the kept blocks are known. Each send counts its work into the engine table
at once (requests decided meanwhile see it); a prefill engine that fails after the decode engine took the
turn gets the turn aborted, so nothing holds a buffer nobody fills.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from services.router import metrics
from services.router.dispatch import Dispatch, publish_abort
from services.router.streams import StreamTable
from shared.blocks import max_hit_blocks
from shared.errors import KvpathError, error_from_code
from shared.protocol import GenerateTask, KvPlan, RequestPlan, TaskAck
from shared.protocol.tasks import BufferRef, DecodeTask, PrefillTask, Task

HistoryPlan = Callable[[int], KvPlan]  # the decode engine's kept blocks -> the prefill engine's KV plan


async def ask(dispatch: Dispatch, engine_id: str, task: Task, deadline: float) -> TaskAck:
    """Send a task to an engine and wait for its ack (`Dispatch.send_task`: a lost ack is asked again)."""
    return await dispatch.send_task(engine_id, task, deadline)


def raise_refusal(ack: TaskAck, what: str) -> None:
    if not ack.accepted:
        raise error_from_code(ack.code or "overloaded", ack.message or what)


def stored_blocks(plan: RequestPlan, locality: Mapping[str, int], block_size: int) -> int:
    """Leading blocks of the prompt in storage (the index's `store` location; without per-location answers,
    the plan's hit count), never more than a prefill may skip."""
    usable = max_hit_blocks(plan.num_prompt_tokens, block_size)
    stored = locality.get("store", 0) if locality else plan.kv.num_hit_blocks
    return min(stored, usable)


def pooled_blocks(plan: RequestPlan, locality: Mapping[str, int], block_size: int) -> int:
    """Leading blocks of the prompt in a KV pool (the index's `cxl:<pool>` locations), never more than a
    prefill may skip."""
    pooled = max((n for loc, n in locality.items() if loc.startswith("cxl:")), default=0)
    return min(pooled, max_hit_blocks(plan.num_prompt_tokens, block_size))


def kv_need(plan: RequestPlan) -> int:
    """Cache tokens the request may fill on its decode engine."""
    return plan.num_prompt_tokens + plan.sampling.max_tokens


async def send_local(
    dispatch: Dispatch,
    plan: RequestPlan,
    de: str,
    stored_blocks: int,
    deadline: float,
    *,
    read_side: str = "",
) -> dict[str, float]:
    """The decode engine prefills the turn itself (from its resident KV, or `stored_blocks` of storage;
    `read_side` "pool": of the pool, storage below it)."""
    plan.kv = plan.kv.with_hits(stored_blocks, read_side)
    ack = await ask(dispatch, de, GenerateTask(plan=plan), deadline)
    raise_refusal(ack, "session engine refused the turn")
    dispatch.engines.note_assigned(de, plan.num_prompt_tokens, kv_tokens=kv_need(plan))
    return {}


async def take_turn(
    dispatch: Dispatch, plan: RequestPlan, pair: tuple[str, str], deadline: float, *, de_kv: KvPlan | None
) -> BufferRef:
    """The DE reserves the buffer its PE writes into (`de_kv`; None: no hits, it keeps what it holds)."""
    pe, de = pair
    plan.kv = de_kv if de_kv is not None else plan.kv.with_hits()
    de_ack = await ask(dispatch, de, DecodeTask(plan=plan, pe_id=pe), deadline)
    raise_refusal(de_ack, "decode engine refused the turn")
    if de_ack.buffer is None:
        raise error_from_code("internal_error", f"decode engine {de} named no buffer")
    dispatch.engines.note_assigned(de, plan.num_prompt_tokens, kv_tokens=kv_need(plan))
    return de_ack.buffer


async def prefill_turn(
    dispatch: Dispatch,
    plan: RequestPlan,
    pair: tuple[str, str],
    buffer: BufferRef,
    history: HistoryPlan,
    deadline: float,
    streams: StreamTable,
    *,
    placed: float,
) -> dict[str, float]:
    """The PE prefills the DE's turn with `history(kept blocks)` (`placed`: when the sends began)."""
    pe = pair[0]
    plan.kv = history(buffer.num_kept_blocks)
    timings = {"schedule_s": 0.0, "allocate_s": time.monotonic() - placed}
    streams.assign(plan.request_id, pe)
    try:
        pe_ack = await ask(dispatch, pe, PrefillTask(plan=plan, de_buffer=buffer, timings=timings), deadline)
    except KvpathError as exc:  # the DE holds a turn nobody will prefill: drop it, fail the request
        await publish_abort(dispatch.bus, plan.request_id, "prefill engine unreachable")
        raise error_from_code("engine_failed", f"prefill engine {pe}: {exc.message}") from exc
    if not pe_ack.accepted:
        await publish_abort(dispatch.bus, plan.request_id, "prefill engine refused")
        raise error_from_code(pe_ack.code or "overloaded", pe_ack.message or "prefill engine refused")
    dispatch.engines.note_assigned(pe, plan.num_prompt_tokens)
    timings["allocate_s"] = time.monotonic() - placed
    metrics.TTFT_STAGE.labels("allocate").observe(timings["allocate_s"])
    return timings

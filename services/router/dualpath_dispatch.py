"""DualPath's dispatch: a request waits in the placement queue (`disaggregated.py`) for a (PE, DE, read side),
then goes to its DE first (which reserves the buffer the PE writes into), then to its PE.

An engine that no service answers for (it died, and the router has not yet heard its silence) is left out
of placements until it reports again (`EngineTable.suspect`), and the request is placed again without it, as
the colocated and session dispatches try another engine: before, the client got a 503 for every request
placed on a dead engine until the silence timeout. A PE found gone after its DE took the turn has the turn
aborted and the retry goes under its own id (`attempt_request_id`), so the abort never meets it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from services.policy.snapshot import ROLE_DECODE, PendingRequest, Placement
from services.router import metrics
from services.router.disaggregated import PlacementQueue, SchedulerParams
from services.router.dispatch import (
    MAX_DISPATCH_ATTEMPTS,
    TIMER_SLACK_S,
    Dispatch,
    attempt_request_id,
    publish_abort,
)
from services.router.engines import EngineTable
from services.router.pd_tasks import ask
from services.router.streams import StreamTable
from shared import telemetry
from shared.bus import Bus
from shared.errors import KvpathError, OverloadedError, ServiceUnavailableError, error_from_code
from shared.protocol import KvPlan, RequestPlan, TaskAck
from shared.protocol.tasks import BufferRef, DecodeTask, PrefillTask, Task

log = logging.getLogger(__name__)


class _Gone(Exception):
    """No service answered for an engine of the placement (`taken`: after its DE took the turn)."""

    def __init__(self, engine_id: str, error: KvpathError, *, taken: bool) -> None:
        super().__init__(error.message)
        self.engine_id, self.error, self.taken = engine_id, error, taken


class DisaggregatedDispatch(Dispatch):
    """Places a request (PE, DE, read side) and hands it to both engines: DE first (its buffer), then PE."""

    def __init__(
        self, engines: EngineTable, bus: Bus, router_id: str, ack_timeout_s: float, params: SchedulerParams
    ) -> None:
        super().__init__(engines, bus, router_id, ack_timeout_s)
        self.queue = PlacementQueue(engines, params)

    def on_load_report(self, engine_id: str) -> None:
        self.queue.kick()

    async def run(self) -> None:
        await self.queue.run()

    async def dispatch(
        self, plan: RequestPlan, deadline: float, streams: StreamTable, locality: Mapping[str, int]
    ) -> dict[str, float]:
        """Return the router-side timings (schedule_s, allocate_s); raise if no engine pair takes it. An
        engine found gone is left out and the request placed again (under a new id once its DE took it)."""
        request_id, kv = plan.request_id, plan.kv
        task, error = plan, None
        for attempt in range(MAX_DISPATCH_ATTEMPTS):
            if attempt:
                task = replace(plan, request_id=attempt_request_id(request_id, attempt))
                streams.retarget(request_id, task.request_id)
            try:
                return await self._dispatch_once(task, kv, deadline, streams)
            except _Gone as gone:
                error = gone.error
                if self.engines.suspect(gone.engine_id):
                    metrics.ENGINES_SUSPECTED.inc()
                log.warning(
                    "engine gone request_id=%s engine=%s: %s; placed again",
                    request_id, gone.engine_id, gone.error.message,
                )  # fmt: skip
                if gone.taken:  # the DE holds a turn nobody will prefill
                    await publish_abort(self.bus, task.request_id, "prefill engine unreachable")
            if time.monotonic() >= deadline - TIMER_SLACK_S:
                break
        assert error is not None
        raise error

    async def _dispatch_once(
        self, plan: RequestPlan, kv: KvPlan, deadline: float, streams: StreamTable
    ) -> dict[str, float]:
        """One placement and its two sends (`kv`: the plan's KV part as the router made it). A decode
        engine that refuses for want of room (its DE buffer or queue full: nothing was reserved there)
        counts as full until its next report, and the request is placed again, until its deadline."""
        started = time.monotonic()
        plan.kv = kv  # an attempt before may have rewritten it
        while True:
            placement = await self._place(plan, deadline)
            placed = time.monotonic()
            metrics.TTFT_STAGE.labels("schedule").observe(placed - started)
            read_side = placement.read_side.value if placement.read_side is not None else ""
            hits = kv.num_hit_blocks if read_side else 0
            plan.kv = kv.with_hits(hits, read_side)
            log.debug(
                "placed request_id=%s pe=%s de=%s read_side=%s",
                plan.request_id, placement.pe_id, placement.de_id, read_side or "none",
            )  # fmt: skip
            task = DecodeTask(plan=plan, pe_id=placement.pe_id)
            de_ack = await self._ask(placement, placement.de_id, task, deadline, taken=False)
            if de_ack.accepted and de_ack.buffer is not None:
                break
            self.queue.taken(placement.pe_id, plan.request_id, accepted=False)
            refusal = error_from_code(de_ack.code or "overloaded", de_ack.message or "decode engine refused")
            if not isinstance(refusal, OverloadedError) or time.monotonic() >= deadline - TIMER_SLACK_S:
                raise refusal
            self.engines.note_refused(placement.de_id, placement.pe_id, plan.num_prompt_tokens)
            metrics.DECODE_REFUSED.inc()
            log.debug("decode engine %s full (%s): request_id=%s placed again", placement.de_id,
                      refusal.message, plan.request_id)  # fmt: skip
        streams.assign(plan.request_id, placement.de_id)
        streams.assign(plan.request_id, placement.pe_id)
        try:
            return await self._prefill(plan, placement, de_ack.buffer, deadline, (started, placed))
        except _Gone:
            streams.unassign(plan.request_id, placement.de_id)
            streams.unassign(plan.request_id, placement.pe_id)
            raise

    async def _prefill(
        self,
        plan: RequestPlan,
        placement: Placement,
        buffer: BufferRef,
        deadline: float,
        times: tuple[float, float],
    ) -> dict[str, float]:
        """Hand the prefill to the PE, which writes the prompt's KV into the decode engine's `buffer`
        (`times`: when the dispatch started, and when its placement was made)."""
        started, placed = times
        timings = {"schedule_s": placed - started, "allocate_s": time.monotonic() - placed}
        is_layerwise = self.queue.params.policy != "basic"
        task = PrefillTask(plan=plan, de_buffer=buffer, is_layerwise=is_layerwise, timings=timings)
        pe_ack = await self._ask(placement, placement.pe_id, task, deadline, taken=True)
        self.queue.taken(placement.pe_id, plan.request_id, accepted=pe_ack.accepted)
        if not pe_ack.accepted:
            raise error_from_code(pe_ack.code or "overloaded", pe_ack.message or "prefill engine refused")
        timings["allocate_s"] = time.monotonic() - placed
        metrics.TTFT_STAGE.labels("allocate").observe(timings["allocate_s"])
        return timings

    async def _ask(
        self, placement: Placement, engine_id: str, task: Task, deadline: float, *, taken: bool
    ) -> TaskAck:
        """Send one of the placement's tasks; a failed send gives the PE's place back (an engine no service
        answers for: `_Gone`, `taken` once the DE took the turn)."""
        try:
            return await ask(self, engine_id, task, deadline)
        except ServiceUnavailableError as exc:
            self.queue.taken(placement.pe_id, task.request_id, accepted=False)
            raise _Gone(engine_id, exc, taken=taken) from exc
        except BaseException:
            self.queue.taken(placement.pe_id, task.request_id, accepted=False)
            raise

    async def _place(self, plan: RequestPlan, deadline: float) -> Placement:
        """Wait for a placement; the wait is the `schedule` span (the task requests carry the HTTP span)."""
        kv_format = self.engines.kv_format
        block_size = kv_format.block_size if kv_format is not None else 1
        need = plan.num_prompt_tokens + plan.sampling.max_tokens
        if largest := self.engines.largest_kv_blocks(ROLE_DECODE, time.monotonic()) * block_size:
            need = max(plan.num_prompt_tokens, min(need, largest))  # else no placement ever finds room
        request = PendingRequest(
            request_id=plan.request_id,
            prompt_tokens=plan.num_prompt_tokens,
            hit_tokens=plan.kv.num_hit_blocks * block_size,
            hbm_need_tokens=need,
        )
        with telemetry.span("schedule") as span:
            placement = await self.queue.place(request, deadline)
            if span is not None:
                span.set_attributes(_placement_attributes(self.queue.params.policy, placement))
        return placement


def _placement_attributes(policy: str, placement: Placement) -> dict[str, Any]:
    return {
        "policy": policy,
        "pe_id": placement.pe_id,
        "de_id": placement.de_id,
        "read_side": placement.read_side.value if placement.read_side is not None else "",
        "read_node": placement.read_node if placement.read_node is not None else -1,
    }

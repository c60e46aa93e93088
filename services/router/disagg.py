"""The live side of DualPath's global scheduler: a FIFO of requests waiting for a (PE, DE, read side).

Every arrival and every load report triggers a placement round: the engines' and nodes' snapshots are built
from the latest load reports plus what the router sent since (`EngineTable`), the round function the
simulator also runs (`services/policy/round.py`) decides, and each placed request's waiter wakes up with its
`Placement`.
Requests the policy cannot place yet (every PE above beta, no DE with room) wait here: that is the
"schedule" part of the TTFT breakdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeVar

from services.policy.round import RoundState, place_round
from services.policy.snapshot import ROLE_PREFILL, PendingRequest, Placement
from services.policy.thresholds import Thresholds, thresholds_from_rates
from services.router import metrics
from services.router.engines import EngineTable
from services.router.prompts import PreparedPrompt
from services.router.streams import StreamTable
from shared import telemetry
from shared.bus import Bus
from shared.errors import DeadlineExceededError, NoEngineAvailableError, error_from_code
from shared.protocol import Message, SamplingParams, TaskAck
from shared.protocol.disagg import DecodeAck, DecodeTask, PrefillTask

R = TypeVar("R", bound=Message)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Waiting:
    request: PendingRequest
    future: asyncio.Future[Placement]


@dataclass(frozen=True, slots=True)
class SchedulerParams:
    policy: str
    block_size: int
    kv_bytes_per_token: int
    alpha_s: float
    beta_s: float
    z_factor: float
    force_read_side: str = ""  # experiments: override the policy's side when that side can read


class Dispatcher:
    def __init__(self, engines: EngineTable, params: SchedulerParams) -> None:
        self.engines = engines
        self.params = params
        self.queue: OrderedDict[str, _Waiting] = OrderedDict()
        self.state = RoundState()
        self._kick = asyncio.Event()
        self.num_rounds = 0

    async def place(self, request: PendingRequest, deadline: float) -> Placement:
        """Queue the request and wait (until the monotonic `deadline`) for its placement."""
        future: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        self.queue[request.request_id] = _Waiting(request, future)
        self.kick()
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceededError("no prefill/decode engine could take the request in time") from None
        finally:
            self.queue.pop(request.request_id, None)

    def kick(self) -> None:
        if self.queue:
            self._kick.set()

    async def run(self) -> None:
        """Placement rounds, one whenever something changed and requests wait."""
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                self.round()
            except Exception:  # a bad snapshot must not stop scheduling; the next kick retries
                log.exception("placement round failed")

    def round(self) -> int:
        """One placement round over the current snapshot; return how many requests were placed."""
        waiting = [w for w in self.queue.values() if not w.future.done()]
        if not waiting:
            return 0
        engines, nodes = self.engines.cluster_snapshot(self.params.block_size)
        result = place_round(
            self.params.policy,
            engines,
            nodes,
            [w.request for w in waiting],
            self.thresholds(),
            self.state,
            force_read_side=self.params.force_read_side,
        )
        if result.missing_roles:  # nothing can place them: fail fast (503), not at the deadline
            error = NoEngineAvailableError(f"no live {' or '.join(result.missing_roles)} engine")
            for w in waiting:
                w.future.set_exception(error)
            return 0
        self.state = result.state
        self.num_rounds += 1
        for placement in result.placements:
            waiter = self.queue.get(placement.request_id)
            if waiter is None or waiter.future.done():
                continue
            self._note(placement, waiter.request)
            waiter.future.set_result(placement)
        return len(result.placements)

    def _note(self, placement: Placement, request: PendingRequest) -> None:
        """Count the decision into the loads until the engines' next reports include it."""
        self.engines.note_assigned(placement.pe_id, request.prompt_tokens)
        self.engines.note_assigned(placement.de_id, request.prompt_tokens, kv_tokens=request.hbm_need_tokens)
        if placement.read_node is not None:
            storage = self.engines.storage_of(placement.read_node)
            if storage is not None:
                self.engines.note_assigned(storage, placement.read_tokens)

    def thresholds(self) -> Thresholds:
        now = time.monotonic()
        read_rates = []
        for st in self.engines.live(now, roles=("storage",)):
            bandwidth = st.report.rates.get("read_bandwidth_bytes_per_s", 0.0)
            if bandwidth > 0:
                read_rates.append(bandwidth / self.params.kv_bytes_per_token)
        prefill_rates = [
            st.report.rates.get("prefill_tokens_per_s", 0.0)
            for st in self.engines.live(now, roles=(ROLE_PREFILL,))
        ]
        return thresholds_from_rates(
            read_rates,
            prefill_rates,
            alpha_s=self.params.alpha_s,
            beta_s=self.params.beta_s,
            z_factor=self.params.z_factor,
        )


class DisaggregatedDispatch:
    """Places a request (PE, DE, read side) and hands it to both engines: DE first (its buffer), then PE."""

    def __init__(self, dispatcher: Dispatcher, bus: Bus, router_id: str, ack_timeout_s: float) -> None:
        self.dispatcher = dispatcher
        self.bus = bus
        self.router_id = router_id
        self.ack_timeout_s = ack_timeout_s

    async def dispatch(
        self,
        prompt: PreparedPrompt,
        request_id: str,
        sampling: SamplingParams,
        deadline: float,
        kv: dict,
        streams: StreamTable,
    ) -> dict[str, float]:
        """Return the router-side timings (schedule_s, allocate_s); raise if no engine pair takes it."""
        params = self.dispatcher.params
        hits = int(kv.get("num_hit_blocks", 0))
        started = time.monotonic()
        # the placement wait is the `schedule` span; the task requests below carry the HTTP span instead
        with telemetry.span("schedule") as span:
            placement = await self.dispatcher.place(
                PendingRequest(
                    request_id=request_id,
                    prompt_tokens=len(prompt.token_ids),
                    hit_tokens=hits * params.block_size,
                    hbm_need_tokens=len(prompt.token_ids) + prompt.max_tokens,
                ),
                deadline,
            )
            if span is not None:
                span.set_attributes(_placement_attributes(params.policy, placement))
        placed = time.monotonic()
        metrics.TTFT_STAGE.labels("schedule").observe(placed - started)
        streams.assign(request_id, placement.de_id)
        streams.assign(request_id, placement.pe_id)
        read_side = placement.read_side.value if placement.read_side is not None else ""
        log.debug(
            "placed request_id=%s pe=%s de=%s read_side=%s",
            request_id, placement.pe_id, placement.de_id, read_side or "none",
        )  # fmt: skip
        common: dict[str, Any] = {
            "request_id": request_id,
            "router_id": self.router_id,
            "prompt_token_ids": prompt.token_ids,
            "sampling": sampling,
            "deadline_unix_s": time.time() + (deadline - time.monotonic()),
            "read_side": read_side,
            "num_hit_blocks": hits if read_side else 0,
            "session_id": prompt.request.session_id,
        }
        de_ack = await self._ask(
            placement.de_id, DecodeTask(pe_id=placement.pe_id, **common), DecodeAck, deadline
        )
        if not de_ack.accepted or de_ack.buffer is None:
            raise error_from_code(de_ack.code or "overloaded", de_ack.message or "decode engine refused")
        timings = {"schedule_s": placed - started}
        timings["allocate_s"] = time.monotonic() - placed
        task = PrefillTask(
            de_buffer=de_ack.buffer, is_layerwise=params.policy != "basic", timings=timings, **common
        )
        pe_ack = await self._ask(placement.pe_id, task, TaskAck, deadline)
        if not pe_ack.accepted:
            raise error_from_code(pe_ack.code or "overloaded", pe_ack.message or "prefill engine refused")
        timings["allocate_s"] = time.monotonic() - placed
        metrics.TTFT_STAGE.labels("allocate").observe(timings["allocate_s"])
        return timings

    async def _ask(self, engine_id: str, task: Message, reply: type[R], deadline: float) -> R:
        timeout = min(self.ack_timeout_s, max(0.01, deadline - time.monotonic()))
        return await self.bus.request(self.bus.subjects.task(engine_id), task, reply, timeout_s=timeout)


def _placement_attributes(policy: str, placement: Placement) -> dict[str, Any]:
    return {
        "policy": policy,
        "pe_id": placement.pe_id,
        "de_id": placement.de_id,
        "read_side": placement.read_side.value if placement.read_side is not None else "",
        "read_node": placement.read_node if placement.read_node is not None else -1,
    }

"""Disaggregated placement (DualPath): the queue of requests waiting for a (PE, DE, read side); the tasks
that follow a placement are `dualpath_dispatch.py`'s.

Every arrival and every load report triggers a placement round: the engines' and nodes' loads are the latest
load reports plus what the router sent since (`EngineTable.load_table`, updated in place for the services
that changed since the last round), the round function the simulator also runs (`services/policy/round.py`)
decides, and each placed request's waiter wakes up with its
`Placement`. Requests the policy cannot place yet (every PE above beta, no DE with room) wait here: that is
the "schedule" part of the TTFT breakdown. A placed request goes to its DE first (which reserves the buffer
the PE writes into), then to its PE.

The queue is first come, first served, as the paper's scheduler is; `--prefill-order short-first` offers
it to each round shortest compute first instead (`services/policy/short_first.py`, the engines' rule), so
an agent's warm turn is not held behind every cold prompt that arrived before it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from services.policy.round import RoundState, place_table_round
from services.policy.short_first import (
    PAST_BETA_TRIES,
    RATIO,
    PrefillQueue,
    WaitingPrefill,
    past_beta_prefix,
    postponements,
    short_first_order,
)
from services.policy.snapshot import PendingRequest, Placement
from services.policy.thresholds import Thresholds, thresholds_from_rates
from services.router.engines import EngineTable
from shared.errors import DeadlineExceededError, NoEngineAvailableError
from shared.protocol import COMPUTE_RATE, Message

R = TypeVar("R", bound=Message)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerParams:
    policy: str
    alpha_s: float
    beta_s: float
    z_factor: float
    force_read_side: str = ""  # experiments: override the policy's side when that side can read
    prefill_order: str = "fcfs"  # fcfs | short-first: the order the waiting requests are offered in
    short_first_ratio: float = RATIO  # short-first: a request may be passed for this x its own compute


PREFILL_ORDERS = ("fcfs", "short-first")
UNTAKEN_REPORTS = 100  # a sent prefill not acked within this many of its PE's reports never reached it


@dataclass(slots=True)
class _Waiting:
    request: PendingRequest
    future: asyncio.Future[Placement]
    postponed_tokens: int = 0  # short-first: compute placed ahead of it so far

    def prefill(self) -> WaitingPrefill:
        """The request as the short-first rule sees it: the tokens its PE computes (at least one)."""
        compute = max(1, self.request.prompt_tokens - self.request.hit_tokens)
        return WaitingPrefill(compute, compute, self.postponed_tokens)


class PlacementQueue:
    """The router's queue of requests waiting for a placement (arrival order), and the rounds that place
    them."""

    def __init__(self, engines: EngineTable, params: SchedulerParams) -> None:
        self.engines = engines
        self.params = params
        self.queue: OrderedDict[str, _Waiting] = OrderedDict()
        self.state = RoundState()
        self._kick = asyncio.Event()
        self.num_rounds = 0
        # short-first: PE -> request -> (tokens to compute, the PE's report seq when it was sent, the seq from
        # which its reports must list it or it never reached the PE), counted ahead until then
        self._sent: dict[str, dict[str, tuple[int, int, int]]] = {}

    def enqueue(self, request: PendingRequest) -> asyncio.Future[Placement]:
        """Queue the request; the future is its placement, set by a round (`kvpath bench placement` runs
        rounds itself)."""
        future: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        self.queue[request.request_id] = _Waiting(request, future)
        return future

    async def place(self, request: PendingRequest, deadline: float) -> Placement:
        """Queue the request and wait (until the monotonic `deadline`) for its placement."""
        future = self.enqueue(request)
        self.kick()
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceededError("no prefill/decode engine could take the request in time") from None
        except BaseException:  # cancelled, perhaps just after a round placed it: nothing is sent
            if future.done() and not future.cancelled() and future.exception() is None:
                self.taken(future.result().pe_id, request.request_id, accepted=False)
            raise
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
        kv_format = self.engines.kv_format
        if not waiting or kv_format is None:
            return 0
        if self.params.prefill_order == "short-first":
            return self._round_short_first(waiting)
        return self._round(waiting)

    def _round_short_first(self, waiting: list[_Waiting]) -> int:
        """A round over the queue offered shortest first; the requests the placed ones passed are
        postponed by them."""
        prefills = [w.prefill() for w in waiting]
        order = short_first_order(prefills, self.params.short_first_ratio)
        offered = [waiting[i] for i in order]
        placed = self._round(offered)
        placed += self._past_beta([w for w in offered if not w.future.done()])
        if placed:
            done = [i for i in order if waiting[i].future.done()]
            for w, added in zip(waiting, postponements(prefills, done), strict=True):
                w.postponed_tokens += added
        return placed

    def _past_beta(self, waiting: list[_Waiting]) -> int:
        """Requests the round left waiting (no PE under beta) that a PE ordering its own queue shortest
        first would run within beta_s anyway: the work it runs before each (its prefills with fewer tokens
        left, `work_ahead`) takes under beta_s of its compute. DualPath's rule with beta lifted picks the
        PE, DE and read side; the placement stands only on such a PE. Beta bounds the wait a PE adds to a
        request, which for a warm turn behind a cold prompt is one step, not the cold prompt's prefill."""
        kv_format = self.engines.kv_format
        if not waiting or kv_format is None:
            return 0
        t = self.thresholds(kv_format.bytes_per_token)
        lifted = Thresholds(t.alpha_tokens, math.inf, t.z_factor)
        tries = waiting[:PAST_BETA_TRIES]
        table = self.engines.load_table(kv_format.block_size)
        result = place_table_round(
            self.params.policy, table, [w.request for w in tries], lifted, self.state,
            force_read_side=self.params.force_read_side,
        )  # fmt: skip
        by_id = {w.request.request_id: w for w in tries}
        tokens = {rid: w.prefill().tokens_left for rid, w in by_id.items()}
        placed = past_beta_prefix(result.placements, tokens, self._queue_of)
        for placement in result.placements[:placed]:
            self._note(placement, by_id[placement.request_id].request)
            by_id[placement.request_id].future.set_result(placement)
        if placed:
            self.state = result.state
        return placed

    def _queue_of(self, pe_id: str) -> PrefillQueue | None:
        """A live PE that orders its queue shortest first, as its report lists it, with what this router
        sent it that its reports may not list yet; None for any other PE."""
        state = self.engines.get(pe_id)
        if state is None or state.is_suspect:
            return None
        r = state.report
        sent = self._current_sent(pe_id, r.seq)
        limit = self.params.beta_s * r.rates.get(COMPUTE_RATE, 0.0)
        if r.prefill_order != "short-first" or r.is_draining or limit <= 0:
            return None
        left, unlisted = r.prefill_left_tokens, [tokens for tokens, _, _ in sent.values()]
        if len(left) < r.num_prefills:  # the report lists the fewest: past its last, nothing is known
            unlisted = [x for x in unlisted if left and x <= left[-1]]
        return PrefillQueue(sorted([*left, *unlisted]), r.num_prefills + len(sent), limit)

    def _current_sent(self, pe_id: str, seq: int) -> dict[str, tuple[int, int, int]]:
        """What was sent to the PE that its report numbered `seq` may not list."""
        sent = self._sent.setdefault(pe_id, {})
        for rid in [rid for rid, (_, since, until) in sent.items() if not since <= seq < until]:
            del sent[rid]  # listed by now, never taken, or the PE restarted (its seq begins again)
        return sent

    def taken(self, pe_id: str, request_id: str, accepted: bool) -> None:
        """The PE took the request's prefill task (`accepted`), or the dispatch failed."""
        sent = self._sent.get(pe_id, {})
        if request_id in sent:
            state = self.engines.get(pe_id)
            if accepted and state is not None:  # the report after the next one was made after it was taken
                tokens, since, _ = sent[request_id]
                sent[request_id] = (tokens, since, state.report.seq + 2)
            else:
                del sent[request_id]

    def _round(self, waiting: list[_Waiting]) -> int:
        """One round over `waiting` (in the order offered)."""
        kv_format = self.engines.kv_format
        assert kv_format is not None
        result = place_table_round(
            self.params.policy,
            self.engines.load_table(kv_format.block_size),
            [w.request for w in waiting],
            self.thresholds(kv_format.bytes_per_token),
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
        state = self.engines.get(placement.pe_id)
        if self.params.prefill_order == "short-first" and state is not None:
            compute, seq = max(1, request.prompt_tokens - request.hit_tokens), state.report.seq
            entry = (compute, seq, seq + UNTAKEN_REPORTS)
            self._current_sent(placement.pe_id, seq)[request.request_id] = entry
        self.engines.note_assigned(placement.pe_id, request.prompt_tokens)
        self.engines.note_assigned(placement.de_id, request.prompt_tokens, kv_tokens=request.hbm_need_tokens)
        if placement.read_node is not None:
            storage = self.engines.storage_of(placement.read_node)
            if storage is not None:
                self.engines.note_assigned(storage, placement.read_tokens)

    def thresholds(self, kv_bytes_per_token: int) -> Thresholds:
        """alpha / beta in tokens from the storage services' read bandwidths and the PEs' prefill rates (those
        of the live services as of the round's `load_table`)."""
        bandwidths, prefill_rates = self.engines.rates()
        return thresholds_from_rates(
            [b / kv_bytes_per_token for b in bandwidths if b > 0],
            prefill_rates,
            alpha_s=self.params.alpha_s,
            beta_s=self.params.beta_s,
            z_factor=self.params.z_factor,
        )

"""The router's session bookkeeping for AMPD (pure, no I/O): which decode engine each session is bound to,
and what the router has seen of its requests since dispatch, the inputs of Algorithm 1.

* `SessionTable`: session id -> bound decode engine, least recently used dropped past `max_sessions`.
* `FlightBook`: per dispatched request, where its prefill runs and since when. It keeps the prefill queues
  (requests sent to an engine whose first token has not come back: the Eq. 1/2 queues, in-flight work
  included because the router cannot tell queued from running) and the windowed statistics: each prefill
  engine's TTFT over the remote prefills it served, each decode engine's ITL per token (the TTFT gap
  excluded), both measured where the client sees them, on the router's clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from services.policy.ampd_stats import EngineWindows
from shared.protocol import TokenBatch

MAX_SESSIONS = 1_000_000


class SessionTable:
    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._bound: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bound)

    def bound(self, session_id: str) -> str | None:
        engine_id = self._bound.get(session_id)
        if engine_id is not None:
            self._bound.move_to_end(session_id)
        return engine_id

    def bind(self, session_id: str, engine_id: str) -> None:
        self._bound[session_id] = engine_id
        self._bound.move_to_end(session_id)
        while len(self._bound) > self.max_sessions:
            self._bound.popitem(last=False)

    def unbind(self, session_id: str) -> None:
        self._bound.pop(session_id, None)


@dataclass(slots=True)
class Flight:
    prefill_engine: str  # a PE, or the session's DE for a local prefill
    decode_engine: str
    work: tuple[int, int]  # (l_hist, l_incr) of its prefill
    started: float
    is_local: bool
    has_first_token: bool = False
    last_token_at: float = 0.0


class FlightBook:
    def __init__(self, window_s: float) -> None:
        self.ttft = EngineWindows(window_s)  # by prefill engine, remote prefills only
        self.itl = EngineWindows(window_s)  # by decode engine, per token
        self._flights: dict[str, Flight] = {}
        self._queued: dict[str, dict[str, tuple[int, int]]] = {}  # engine -> request -> (l_hist, l_incr)

    def __len__(self) -> int:
        return len(self._flights)

    def queue(self, engine_id: str) -> tuple[tuple[int, int], ...]:
        return tuple(self._queued.get(engine_id, {}).values())

    def start(self, request_id: str, flight: Flight) -> None:
        self.end(request_id)
        self._flights[request_id] = flight
        self._queued.setdefault(flight.prefill_engine, {})[request_id] = flight.work

    def end(self, request_id: str) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is not None and not flight.has_first_token:
            self._dequeue(request_id, flight)

    def _dequeue(self, request_id: str, flight: Flight) -> None:
        queued = self._queued.get(flight.prefill_engine)
        if queued is not None:
            queued.pop(request_id, None)
            if not queued:
                del self._queued[flight.prefill_engine]

    def observe(self, batch: TokenBatch, now: float) -> None:
        """Token deltas arrived: a first token ends its prefill (a TTFT sample of a remote PE), later ones
        are ITL samples of the decode engine."""
        for delta in batch.deltas:
            flight = self._flights.get(delta.request_id)
            if flight is None:
                continue
            num_tokens = len(delta.token_ids)
            if delta.seq == 0:
                flight.has_first_token = True
                flight.last_token_at = now
                self._dequeue(delta.request_id, flight)
                if not flight.is_local:
                    self.ttft.add(flight.prefill_engine, now, now - flight.started)
            elif num_tokens and flight.has_first_token:
                gap = (now - flight.last_token_at) / num_tokens
                self.itl.add(flight.decode_engine, now, gap, num_tokens)
                flight.last_token_at = now
            if delta.finish_reason is not None:
                self.end(delta.request_id)

    def forget(self, live_ids: Iterable[str]) -> None:
        live = list(live_ids)
        self.ttft.forget(live)
        self.itl.forget(live)

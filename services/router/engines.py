"""The router's view of live engines, built from their load reports (pure bookkeeping, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import LoadReport


@dataclass(slots=True)
class EngineState:
    report: LoadReport
    received_at: float  # router's monotonic clock
    # work the router sent since that report, so back-to-back decisions see it before the next report
    pending_requests: int = 0
    pending_tokens: int = 0
    pending_kv_tokens: int = 0


class EngineTable:
    """Latest load report per service, keyed by service id; storage services are tracked too."""

    def __init__(self, silence_timeout_s: float) -> None:
        self.silence_timeout_s = silence_timeout_s
        self._engines: dict[str, EngineState] = {}

    def update(self, report: LoadReport, now: float) -> None:
        current = self._engines.get(report.service_id)
        if current is not None and report.seq <= current.report.seq and not report.seq == 1:
            return  # stale or reordered report (seq 1 = the service restarted)
        self._engines[report.service_id] = EngineState(report=report, received_at=now)

    def note_assigned(self, service_id: str, tokens: int, *, kv_tokens: int = 0) -> None:
        state = self._engines.get(service_id)
        if state is not None:
            state.pending_requests += 1
            state.pending_tokens += tokens
            state.pending_kv_tokens += kv_tokens

    def storage_of(self, node: int) -> str | None:
        """The service id of node `node`'s storage service, if it reports."""
        for sid, st in self._engines.items():
            if st.report.role == "storage" and st.report.node == node:
                return sid
        return None

    def remove(self, service_id: str) -> None:
        self._engines.pop(service_id, None)

    def live(self, now: float, *, roles: tuple[str, ...] | None = None) -> list[EngineState]:
        out = []
        for state in self._engines.values():
            if now - state.received_at > self.silence_timeout_s:
                continue
            if roles is not None and state.report.role not in roles:
                continue
            out.append(state)
        return out

    def silent(self, now: float) -> list[str]:
        """Services whose reports stopped: they are dead or cut off."""
        return [sid for sid, st in self._engines.items() if now - st.received_at > self.silence_timeout_s]

    def get(self, service_id: str) -> EngineState | None:
        return self._engines.get(service_id)

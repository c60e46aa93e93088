"""The auto router's ledger of its own plans (`auto_dispatch.py`): per engine, the requests it sent there that
wait for their first token (with the predicted time) and those decoding. Fresher than load reports for one
router's own work; auto prices an engine's queue from it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PlanLedger:
    """What this router sent each engine and has not seen finish: requests waiting for their first token
    (with its predicted time) and requests decoding. Fresher than load reports for one router's own work."""

    first_token_at: dict[str, dict[str, float]] = field(default_factory=dict)
    decoding: dict[str, set[str]] = field(default_factory=dict)

    def add(self, engine_id: str, request_id: str, at: float) -> None:
        self.first_token_at.setdefault(engine_id, {})[request_id] = at

    def started(self, prefill_engine: str, decode_engine: str, request_id: str) -> None:
        """The first token came: the request decodes now (on the engine that prefilled it, or another)."""
        self.first_token_at.get(prefill_engine, {}).pop(request_id, None)
        self.decoding.setdefault(decode_engine, set()).add(request_id)

    def drop(self, engine_id: str, request_id: str) -> None:
        self.first_token_at.get(engine_id, {}).pop(request_id, None)
        self.decoding.get(engine_id, set()).discard(request_id)

    def busy_s(self, engine_id: str, now: float) -> float:
        """How long the engine is busy with what this router sent it, by the router's own predictions."""
        return max([at - now for at in self.first_token_at.get(engine_id, {}).values()] + [0.0])

    def num_decoding(self, engine_id: str) -> int:
        return len(self.decoding.get(engine_id, ()))

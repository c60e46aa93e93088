"""Stop strings over a streamed text (pure).

Text that could be the start of a stop string is held back until it is known not to be one, so a client
never sees part of a stop sequence; the stop string itself is not returned (OpenAI semantics).
"""

from __future__ import annotations


class StopMatcher:
    __slots__ = ("_held", "_max_len", "_stops")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was reached)."""
        if not self._stops:
            return text, False
        pending = self._held + text
        cut = min((i for i in (pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return pending[:cut], True
        keep = self._held_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0

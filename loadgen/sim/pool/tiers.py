"""A KV tier that holds prompt prefixes in whole units (16-token blocks, 256-token super blocks): HBM's prefix
cache, a server's local DRAM tier, the shared pool.

A prompt is a chain of two segments: its document's whole units (shared by every question about it), then
its own whole units (the question, and the unit that straddles the boundary). A tier holds a leading run of
each segment's units, and a lookup walks the chain and stops at the first unit missing, as a block-hash chain
does. Stores add units as a request computes them (partial prefixes are visible, as vLLM's and the
connectors' per-step saves make them). Eviction is LRU over whole segments that no running request pins
(I: the paper does not describe eviction, brief 4.7); a lookup hit refreshes a segment.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loadgen.sim.pool.costs import whole_units
from loadgen.sim.pool.workload import LvRequest

DOC, OWN = 0, 1  # segment kinds: a document's units, a prompt's own units
SegmentKey = tuple[int, int]  # (kind, document or request id)


@dataclass(frozen=True, slots=True)
class UnitRange:
    """Units [first, first + count) of one segment, the pieces a load or store moves."""

    key: SegmentKey
    first: int
    count: int


def segments(request: LvRequest, unit_tokens: int) -> tuple[tuple[SegmentKey, int], ...]:
    """The request's chain: (segment, its whole units) for the document, then for its own part."""
    doc_units = whole_units(request.doc_tokens, unit_tokens)
    own_units = whole_units(request.prompt_tokens, unit_tokens) - doc_units
    return ((DOC, request.doc_id), doc_units), ((OWN, request.request_id), own_units)


def split_units(request: LvRequest, unit_tokens: int, start: int, stop: int) -> list[UnitRange]:
    """Units [start, stop) of the request's chain as per-segment ranges."""
    out: list[UnitRange] = []
    offset = 0
    for key, units in segments(request, unit_tokens):
        lo, hi = max(start, offset), min(stop, offset + units)
        if hi > lo:
            out.append(UnitRange(key, lo - offset, hi - lo))
        offset += units
    return out


class PrefixTier:
    __slots__ = ("_held", "_pins", "capacity_units", "name", "unit_tokens", "used_units")

    def __init__(self, name: str, capacity_units: int, unit_tokens: int) -> None:
        self.name = name
        self.capacity_units = capacity_units
        self.unit_tokens = unit_tokens
        self.used_units = 0
        self._held: OrderedDict[SegmentKey, int] = OrderedDict()  # LRU first
        self._pins: dict[SegmentKey, int] = {}

    def match_units(self, request: LvRequest, *, touch: bool = False) -> int:
        """Leading units of the request's chain this tier holds; `touch` marks them recently used."""
        matched = 0
        for key, units in segments(request, self.unit_tokens):
            held = min(units, self._held.get(key, 0))
            if held and touch:
                self._held.move_to_end(key)
            matched += held
            if held < units:
                break
        return matched

    def match_tokens(self, request: LvRequest) -> int:
        return self.match_units(request) * self.unit_tokens

    def store(self, request: LvRequest, computed_tokens: int) -> list[UnitRange]:
        """Hold every whole unit of the first `computed_tokens` of the prompt; returns the units that were not
        held yet (what a store moves: another request's identical units are not written twice)."""
        stop = whole_units(min(computed_tokens, request.prompt_tokens), self.unit_tokens)
        added: list[UnitRange] = []
        offset = 0
        for key, units in segments(request, self.unit_tokens):
            upto = min(units, stop - offset)
            if upto <= 0:
                break
            held = self._held.get(key, 0)
            if upto > held:
                self._held[key] = upto
                self.used_units += upto - held
                added.append(UnitRange(key, held, upto - held))
            self._held.move_to_end(key)
            if upto < units:
                break
            offset += units
        if added:
            self._evict()
        return added

    def pin(self, request: LvRequest) -> None:
        for key, _ in segments(request, self.unit_tokens):
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, request: LvRequest) -> None:
        for key, _ in segments(request, self.unit_tokens):
            left = self._pins[key] - 1
            if left:
                self._pins[key] = left
            else:
                del self._pins[key]

    def _evict(self) -> None:
        if self.used_units <= self.capacity_units:
            return
        for key in list(self._held):
            if key in self._pins:
                continue
            self.used_units -= self._held.pop(key)
            if self.used_units <= self.capacity_units:
                return

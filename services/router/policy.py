"""Engine choice for the colocated policy, as a pure function over a load snapshot.

The DualPath policies live in `services/router/placement.py` (PE/DE selection, read side) over the snapshot
types of `services/router/dualpath.py`, and the prefill engine's batching in `services/engine/batching.py`;
both the live services and the simulator in `loadgen/sim` call these same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine in a scheduling snapshot."""

    engine_id: str
    role: str
    node: int
    num_unfinished: int  # requests assigned and not finished
    unfinished_tokens: int  # tokens of those requests (prompt + generated so far)
    free_kv_blocks: int
    total_kv_blocks: int
    is_draining: bool = False


def pick_least_loaded(engines: Sequence[EngineLoad], *, role: str = "colocated") -> str | None:
    """Fewest unfinished tokens, then fewest requests, then id (deterministic); None when none can serve."""
    candidates = [e for e in engines if e.role == role and not e.is_draining and e.total_kv_blocks > 0]
    if not candidates:
        return None
    best = min(candidates, key=lambda e: (e.unfinished_tokens, e.num_unfinished, e.engine_id))
    return best.engine_id

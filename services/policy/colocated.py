"""Which engine serves a request when one engine does it all (colocated engines), as pure functions.

* `colocated` and `beluga`: least loaded. With Beluga's shared pool every engine reads cached KV at the same
  cost, so scheduling can ignore where KV is (cache-oblivious).
* `cache-aware`: the baseline of engines with engine-local KV tiers (an RDMA pool behind a local DRAM cache):
  prefer the engine that already holds the prompt's prefix, traded against load, as Dynamo's router does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.policy.snapshot import ROLE_COLOCATED, EngineSnapshot

COLOCATED = "colocated"
BELUGA = "beluga"  # colocated engines over a shared pool tier: cache-oblivious, least loaded
CACHE_AWARE = "cache-aware"  # colocated engines with engine-local KV: Dynamo-style overlap routing
COLOCATED_POLICIES = (COLOCATED, BELUGA, CACHE_AWARE)  # one engine per request


def pick_least_loaded(engines: Sequence[EngineSnapshot], *, role: str = ROLE_COLOCATED) -> str | None:
    """The `colocated` policy, and Beluga's cache-oblivious one (every engine reads the shared pool at the
    same cost, so only load matters): fewest unfinished tokens, then fewest requests, then id
    (deterministic); None when no engine of `role` takes work (none live, or all draining)."""
    candidates = [e for e in engines if e.role == role and not e.is_draining]
    if not candidates:
        return None
    return min(candidates, key=lambda e: (e.unfinished_tokens, e.num_unfinished, e.engine_id)).engine_id


def pick_cache_aware(
    engines: Sequence[EngineSnapshot],
    local_hit_tokens: Mapping[str, int],
    prompt_tokens: int,
    *,
    role: str = ROLE_COLOCATED,
) -> str | None:
    """Cache-aware routing as Dynamo's KV router does it (the baseline Beluga argues against): the engine
    whose local tier already holds the longest prefix of the prompt is credited with the tokens it need not
    fetch or compute. Cost = prompt tokens it must bring in (prompt - local hit) + its unfinished tokens; the
    cheapest wins (then fewer requests, then id). `local_hit_tokens`: engine id -> prompt tokens it holds."""
    candidates = [e for e in engines if e.role == role and not e.is_draining]
    if not candidates:
        return None

    def cost(e: EngineSnapshot) -> tuple[int, int, str]:
        missing = prompt_tokens - min(prompt_tokens, local_hit_tokens.get(e.engine_id, 0))
        return missing + e.unfinished_tokens, e.num_unfinished, e.engine_id

    return min(candidates, key=cost).engine_id

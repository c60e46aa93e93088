"""The memory-bound fan-in of move-the-query, timed: one requester whose KV cache holds a few private copies
of a held chunk, and N sub-agents sharing the chunk that all arrive at once (the live bench's fan-in).

Each sub-agent keeps `resident_kv_tokens` of the requester's cache from its admission until it finishes;
the requester admits them first come first served as memory frees (a request waits at the head of the
line until what it keeps fits). A sub-agent's time once admitted is its primitive's extra time from the
cost model (`request_costs`: the routed exchanges, or the fetch or recompute and local attention over the
chunk) plus `step_s` per answer token for the rest of the model. `auto` decides each sub-agent in arrival
order with the router's rule (`choose`): the requester's free KV less what the sub-agents decided before
it keep, and when each of those gives its KV back (the release schedule a requester's load report
carries: here exact), so a copy of the chunk that does not fit is priced with its wait for memory; and
the sub-agents that arrived at the same instant and are not decided yet (`pending_requests`), so a burst
is priced at the waves it would queue in (`burst_wait_s`). The holder here is a fixed queue per exchange (the
idle or busy holder of the scenario), not one that a burst's routes load, so no `holder_burst` is passed: the
router's term for that load would price a contention this model does not play out.

Per primitive: how many run at once, the median TTFT (admission + the primitive's time to the first
token), and when the last one finishes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from services.policy.movequery import (
    CostProfile,
    Fabric,
    Primitive,
    RouteRequest,
    choose,
    request_costs,
    resident_kv_tokens,
)

MODES = ("route", "fetch", "local", "auto")  # auto: the router's rule (`choose`)


@dataclasses.dataclass(slots=True)
class _Admitted:
    start_s: float
    end_s: float
    tokens: int


def _admit_at(admitted: list[_Admitted], capacity: int, not_before: float, tokens: int) -> float:
    """The first time from `not_before` on at which `tokens` fit beside the admitted ones still running."""
    ends = sorted(a.end_s for a in admitted if a.end_s > not_before)
    for t in [not_before, *ends]:
        if capacity - sum(a.tokens for a in admitted if a.end_s > t) >= tokens:
            return t
    return ends[-1] if ends else not_before  # larger than the whole cache: it runs alone


def timed_fanin(
    profile: CostProfile,
    fabric: Fabric,
    req: RouteRequest,
    *,
    n: int,
    capacity: int,
    step_s: float,
    gap_s: float = 0.0,
) -> dict[str, dict[str, Any]]:
    """N sub-agents shaped like `req`, the k-th arriving at k x `gap_s`, into a requester cache of `capacity`
    KV tokens: per mode of `MODES`, {at_once, ttft_p50_s, latency_p50_s (arrival to finish), makespan_s,
    routed}."""
    total, first = request_costs(profile, fabric, dataclasses.replace(req, free_kv_tokens=None))
    out = {}
    for mode in MODES:
        admitted: list[_Admitted] = []
        ttfts, latencies, routed, start = [], [], 0, 0.0
        for k in range(n):
            now = k * gap_s
            if mode == "auto":
                pending = sum(1 for j in range(k + 1, n) if j * gap_s <= now)  # arrived with it, undecided
                sized = dataclasses.replace(
                    req,
                    pending_requests=pending,
                    kv_capacity_tokens=capacity,
                    decode_step_s=step_s,
                )
                primitive = _auto(profile, fabric, sized, admitted, capacity, now)
            else:
                primitive = Primitive(mode)
            tokens = resident_kv_tokens(primitive, req)
            start = _admit_at(admitted, capacity, max(start, now), tokens)
            p = str(primitive)
            admitted.append(_Admitted(start, start + total[p] + req.decode_steps * step_s, tokens))
            ttfts.append(start + first[p] - now)
            latencies.append(admitted[-1].end_s - now)
            routed += primitive is Primitive.ROUTE
        out[mode] = {
            "at_once": max(sum(a.start_s <= b.start_s < a.end_s for a in admitted) for b in admitted),
            "ttft_p50_s": float(np.median(ttfts)),
            "latency_p50_s": float(np.median(latencies)),
            "makespan_s": max(a.end_s for a in admitted),
            "routed": routed,
        }
    return out


def _auto(
    profile: CostProfile,
    fabric: Fabric,
    req: RouteRequest,
    admitted: list[_Admitted],
    capacity: int,
    now: float,
) -> Primitive:
    """The router's choice for a sub-agent arriving at `now`: the free KV after the sub-agents still there
    (running or queued), and when each of them gives its KV back."""
    there = [a for a in admitted if a.end_s > now]
    sized = dataclasses.replace(
        req,
        free_kv_tokens=capacity - sum(a.tokens for a in there),
        kv_release=tuple(sorted((a.end_s - now, a.tokens) for a in there)),
    )
    return choose(profile, fabric, sized).primitive

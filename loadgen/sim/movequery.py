"""`kvpath loadgen sim --sweep movequery`: the paper's route / fetch / local tables from the cost model.

Pure and analytic: the three primitives and the predicate of `services/policy/movequery.py` evaluated with
the paper's measured constants (`paper_profile`: DeepSeek-V2-Lite absorbed MLA, the five fabrics of Table 2,
the ~3 ms splice, c = 0.5-1.5 us per token and layer). It regenerates:
- the routed dispatch per fabric against M_q (Fig. 4a's shape; ~31-48 us at the decode point M_q = 256);
- the wire bytes route saves against the chunk (Fig. 3b: >= 76% at M_q <= 256, break-even ~1080 / ~270);
- the route/splice ratios (26x at 1024, 60-100x at 256), the route/fetch crossover in M_q per fabric and the
  fetch/local crossover in chunk tokens (75-220);
- the host-overhead regime of the paper's Python client (route TTFT 3.5 ms + 12.5 us M_q against a
  splice-free bytes-back fetch through the same client, 3.5 ms + the pull: fetch wins below ~200 rows);
- the predicate's choice per (fabric, request shape), with every exchange paid once per layer;
- the memory-bound fan-in: N sub-agents of one chunk admitted in order into a requester cache that holds only
  a few copies of it, each taking the KV its primitive keeps (`resident_kv_tokens`), auto deciding with the
  free KV left (`choose`, the router's rule): how many run at once per primitive.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from services.policy.movequery import (
    Primitive,
    RouteRequest,
    byte_break_even_rows,
    choose,
    local_fetch_crossover_tokens,
    resident_kv_tokens,
    route_exchange_s,
    route_fetch_crossover_rows,
)
from services.policy.movequery_profile import PAPER_FABRICS, paper_profile

M_Q = (1, 16, 64, 256, 512, 1024, 2048, 4096)
CHUNK_TOKENS = 2048
HOST_ROUTE_PER_ROW_S = 12.5e-6  # the paper's end-to-end Python client: route TTFT 3.5 ms + 12.5 us M_q


def movequery_sweep() -> dict[str, Any]:
    profile = paper_profile()
    shape = profile.shape
    chunk_layer_bytes = CHUNK_TOKENS * shape.kv_bytes_per_token_layer
    route_us = {
        name: {str(m): route_exchange_s(profile, f, m, CHUNK_TOKENS) * 1e6 for m in M_Q}
        for name, f in PAPER_FABRICS.items()
    }
    splice = profile.compute.splice_s
    pull_s = chunk_layer_bytes * shape.num_layers / PAPER_FABRICS["ibgda"].bandwidth_bytes_per_s
    # a bytes-back fetch through the same client pays the same fixed overhead plus the pull (no splice)
    host_crossover = pull_s / HOST_ROUTE_PER_ROW_S
    return {
        "chunk_tokens": CHUNK_TOKENS,
        "row_bytes": shape.row_bytes,
        "route_us": route_us,
        "bytes_saved": {str(m): 1 - m * shape.row_bytes / chunk_layer_bytes for m in M_Q},
        "byte_break_even_rows": {str(c): byte_break_even_rows(shape, c) for c in (512, 2048)},
        "route_over_splice": {str(m): splice / (route_us["ibgda"][str(m)] * 1e-6) for m in (1, 256, 1024)},
        "route_fetch_crossover_rows": {
            name: route_fetch_crossover_rows(profile, f, CHUNK_TOKENS) for name, f in PAPER_FABRICS.items()
        },
        "fetch_local_crossover_tokens": {
            str(c_us): local_fetch_crossover_tokens(
                dataclasses.replace(paper_profile(c_s=c_us * 1e-6), fetch_bandwidth_bytes_per_s=math.inf)
            )
            for c_us in (0.5, 1.0, 1.5)
        },
        "host_overhead_crossover_rows": host_crossover,
        "choices": _choices(profile),
        "memory_bound_fanin": memory_bound_fanin(profile, PAPER_FABRICS["ibgda"]),
    }


def _choices(profile: Any) -> list[dict[str, Any]]:
    """The predicate per fabric and request shape: a decode-only sub-agent, a long one, a tiny chunk."""
    shapes = {
        "decode 1 step, chunk 2048": RouteRequest(CHUNK_TOKENS, 1, 1),
        "decode 64 steps, chunk 2048": RouteRequest(CHUNK_TOKENS, 1, 64),
        "prefill 512 + 8 steps, chunk 2048": RouteRequest(CHUNK_TOKENS, 512, 8),
        "decode 1 step, chunk 64, no holder": RouteRequest(64, 1, 1, can_route=False),
        "decode 1 step, chunk 512, no holder": RouteRequest(512, 1, 1, can_route=False),
        "decode 64 steps, no room for the chunk": RouteRequest(CHUNK_TOKENS, 1, 64, free_kv_tokens=100),
    }
    return [
        {"fabric": name, "request": label, "choice": str(choose(profile, f, req).primitive)}
        for name, f in PAPER_FABRICS.items()
        for label, req in shapes.items()
    ]


def memory_bound_fanin(
    profile: Any, fabric: Any, *, n: int = 64, copies: int = 3, own_tokens: int = 320, steps: int = 400
) -> dict[str, int]:
    """Sub-agents (chunk 2048 + `own_tokens` prompt, `steps` answer tokens: long enough that fetch wins on
    time) admitted first come first served into a cache of `copies` fetched sub-agents' KV: how many run at
    once under each forced primitive and under auto; `auto_routed`: how many of those auto routed."""
    req = RouteRequest(CHUNK_TOKENS, own_tokens, steps)
    capacity = copies * resident_kv_tokens(Primitive.FETCH, req)
    out = {}
    for mode in ("route", "fetch", "local", "auto"):
        free, admitted, routed = capacity, 0, 0
        for _ in range(n):
            sized = dataclasses.replace(req, free_kv_tokens=free)
            primitive = choose(profile, fabric, sized).primitive if mode == "auto" else Primitive(mode)
            need = resident_kv_tokens(primitive, req)
            if need > free:
                break  # head of line waits for memory
            free, admitted, routed = free - need, admitted + 1, routed + (primitive is Primitive.ROUTE)
        out[mode] = admitted
        if mode == "auto":
            out["auto_routed"] = routed
    return out


def format_movequery(result: dict[str, Any]) -> str:
    lines = [f"routed dispatch, one layer, chunk {result['chunk_tokens']} (us) by M_q rows"]
    lines.append("fabric        " + "".join(f"{m:>8}" for m in M_Q))
    for name, row in result["route_us"].items():
        lines.append(f"{name:<14}" + "".join(f"{row[str(m)]:>8.1f}" for m in M_Q))
    lines.append(
        "wire bytes route saves: " + ", ".join(f"{m}: {s:.1%}" for m, s in result["bytes_saved"].items())
    )
    be = result["byte_break_even_rows"]
    lines.append(f"byte break-even M_q: chunk 2048 -> {be['2048']:.0f}, chunk 512 -> {be['512']:.0f}")
    ratios = ", ".join(f"M_q {m}: {r:.0f}x" for m, r in result["route_over_splice"].items())
    lines.append(f"splice / route (ibgda): {ratios}")
    cross = ", ".join(f"{n} {v:.2g}" for n, v in result["route_fetch_crossover_rows"].items())
    lines.append(f"route/fetch crossover M_q (one exchange vs one fetch): {cross}")
    local = ", ".join(f"c={c} us: {v:.0f}" for c, v in result["fetch_local_crossover_tokens"].items())
    lines.append(f"fetch/local crossover chunk tokens: {local}")
    lines.append(
        f"host-overhead mode (route 3.5 ms + 12.5 us M_q vs bytes-back fetch): fetch wins below "
        f"M_q {result['host_overhead_crossover_rows']:.0f}"
    )
    fan = result["memory_bound_fanin"]
    lines.append(
        "memory-bound fan-in (64 sub-agents, cache of 3 fetched copies, ibgda) running at once: "
        + ", ".join(f"{k} {v}" for k, v in fan.items())
    )
    lines.append("predicate (every exchange once per layer):")
    for c in result["choices"]:
        lines.append(f"  {c['fabric']:<14}{c['request']:<40}{c['choice']}")
    return "\n".join(lines)

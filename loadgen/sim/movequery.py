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
- the memory-bound fan-in, timed (`movequery_memory.py`): N sub-agents of one chunk arriving at once at a
  requester cache that holds only a few copies of it, admitted as memory frees, auto deciding with the
  router's rule (free KV and release times): per primitive how many run at once, TTFT and makespan, with an
  idle holder and with a busy one (where waiting for room to fetch beats routing).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from loadgen.sim.movequery_memory import timed_fanin
from services.policy.movequery import (
    CostProfile,
    Fabric,
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
STEP_S = 0.02  # the rest of the model's decode step in the fan-in (an assumption: the paper gives none)
BUSY_HOLDER_QUEUE_S = 1e-3  # a holder serving other requesters holds each exchange this long
SPACED_GAP_S = 4.0  # sub-agents arriving one by one: about as fast as the cache's copies turn over


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
    profile: CostProfile,
    fabric: Fabric,
    *,
    n: int = 64,
    copies: int = 3,
    own_tokens: int = 320,
    steps: int = 400,
    step_s: float = STEP_S,
) -> dict[str, Any]:
    """Sub-agents (chunk 2048 + `own_tokens` prompt, `steps` answer tokens: long enough that fetch wins on
    time) at a requester whose cache holds `copies` fetched sub-agents' KV (`movequery_memory.timed_fanin`):
    all at once, with an idle holder and with a busy one, and one every `SPACED_GAP_S` to the busy one."""
    req = RouteRequest(CHUNK_TOKENS, own_tokens, steps)
    capacity = copies * resident_kv_tokens(Primitive.FETCH, req)
    busy = dataclasses.replace(req, holder_queue_s=BUSY_HOLDER_QUEUE_S)
    return {
        "n": n,
        "capacity_kv_tokens": capacity,
        "spaced_gap_s": SPACED_GAP_S,
        "burst_idle_holder": timed_fanin(profile, fabric, req, n=n, capacity=capacity, step_s=step_s),
        "burst_busy_holder": timed_fanin(profile, fabric, busy, n=n, capacity=capacity, step_s=step_s),
        "spaced_busy_holder": timed_fanin(
            profile, fabric, busy, n=n, capacity=capacity, step_s=step_s, gap_s=SPACED_GAP_S
        ),
    }


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
        f"memory-bound fan-in, ibgda: {fan['n']} sub-agents into a cache of 3 fetched copies "
        f"({fan['capacity_kv_tokens']} tokens), all at once or one every {fan['spaced_gap_s']:.0f} s: "
        "at once / TTFT p50 / latency p50 / makespan (auto: routed)"
    )
    for case in ("burst_idle_holder", "burst_busy_holder", "spaced_busy_holder"):
        cells = [
            f"{mode} {r['at_once']} / {r['ttft_p50_s']:.1f} / {r['latency_p50_s']:.1f} / "
            f"{r['makespan_s']:.0f} s" + (f" ({r['routed']})" if mode == "auto" else "")
            for mode, r in fan[case].items()
        ]
        lines.append(f"  {case.replace('_', ' ')}: " + ", ".join(cells))
    lines.append("predicate (every exchange once per layer):")
    for c in result["choices"]:
        lines.append(f"  {c['fabric']:<14}{c['request']:<40}{c['choice']}")
    return "\n".join(lines)

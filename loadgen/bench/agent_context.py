"""`kvpath bench agent --only context`: agent sessions with a long context, the workload kvpath is for.
Each turn re-sends the whole context plus `append_tokens` new ones (a tool's output) and streams a short
answer; the answer's stand-in (`answer_tokens` fresh ids) joins the context for the next turn. Reported per
turn: prompt and cached tokens (`usage.prompt_tokens_details.cached_tokens`) and TTFT. It passes when every
turn after the first hits at least MIN_HIT_RATIO of its prompt (agents re-read 95-99% of theirs), the check
that a model with much KV per token (SmolLM2 in fp32: 46 KB per token) keeps its context's blocks.
`--context-sessions N` runs N such sessions at once (their cold first turns queue together, and each later
turn, a few hundred tokens to compute, waits behind whatever the engine prefills: the prefill order's case).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

MIN_HIT_RATIO = 0.9
FIRST_ID, LAST_ID = 300, 20_000  # ordinary ids of a real vocabulary (SmolLM2: 49,152); smaller: 3..vocab


async def long_context_session(
    client: Any, model: str, context_tokens: int, turns: int, *, vocab_size: int = 0,
    append_tokens: int = 100, answer_tokens: int = 4, seed: int = 7,
) -> dict[str, Any]:  # fmt: skip
    """`vocab_size`: the model's (GET /v1/models), 0: unknown (ids FIRST_ID..LAST_ID)."""
    rng = random.Random(seed)
    first, last = (FIRST_ID, LAST_ID) if vocab_size > LAST_ID or not vocab_size else (3, vocab_size)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(first, last) for _ in range(n)]

    context = fresh(context_tokens)
    rows: list[dict[str, Any]] = []
    session = f"bench-context-{seed}-{random.getrandbits(32):08x}"  # sticky session policies bind it
    for _ in range(turns):
        context += fresh(append_tokens)
        rows.append(await _turn(client, model, context, answer_tokens, session))
        context += fresh(answer_tokens)
    later = rows[1:]
    ratios = [r["cached_tokens"] / r["prompt_tokens"] for r in later]
    return {
        "context_tokens": context_tokens,
        "turns": rows,
        "first_ttft_ms": rows[0]["ttft_ms"] if rows else None,
        "later_ttft_ms_median": round(statistics.median(r["ttft_ms"] for r in later), 1) if later else None,
        "later_hit_ratio_min": round(min(ratios), 4) if ratios else None,
        "ok": bool(ratios) and min(ratios) >= MIN_HIT_RATIO,
    }


async def _turn(
    client: Any, model: str, prompt: list[int], answer_tokens: int, session: str
) -> dict[str, Any]:
    started = time.perf_counter()
    first = None
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=answer_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": session},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None or first is None:
        raise RuntimeError("a streamed turn ended without a token or without usage")
    details = usage.prompt_tokens_details
    return {
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": (details.cached_tokens or 0) if details is not None else 0,
        "ttft_ms": round(1000 * first, 1),
    }


async def concurrent_sessions(
    client: Any, model: str, context_tokens: int, turns: int, sessions: int, *, vocab_size: int = 0
) -> dict[str, Any]:
    """`sessions` long-context sessions at once (seeds 7, 8, ...); one session's report as is."""
    runs = await asyncio.gather(
        *(
            long_context_session(client, model, context_tokens, turns, vocab_size=vocab_size, seed=7 + i)
            for i in range(sessions)
        )
    )
    if sessions == 1:
        return runs[0]
    later = [t["ttft_ms"] for r in runs for t in r["turns"][1:]]
    ratios = [r["later_hit_ratio_min"] for r in runs if r["later_hit_ratio_min"] is not None]
    return {
        "context_tokens": context_tokens,
        "sessions": runs,
        "first_ttft_ms_median": statistics.median(r["first_ttft_ms"] for r in runs),
        "later_ttft_ms_median": round(statistics.median(later), 1) if later else None,
        "later_ttft_ms_mean": round(statistics.fmean(later), 1) if later else None,
        "later_ttft_ms_max": max(later) if later else None,
        "later_hit_ratio_min": min(ratios) if ratios else None,
        "ok": all(r["ok"] for r in runs),
    }


def summary_line(c: dict[str, Any]) -> str:
    if "sessions" in c:
        return (
            f"long context, {len(c['sessions'])} sessions at once ({c['context_tokens']} tokens, "
            f"{len(c['sessions'][0]['turns'])} turns): TTFT first median {c['first_ttft_ms_median']} ms, "
            f"later median {c['later_ttft_ms_median']} ms, mean {c['later_ttft_ms_mean']} ms, "
            f"max {c['later_ttft_ms_max']} ms; "
            f"lowest later hit ratio {c['later_hit_ratio_min']} (pass >= {MIN_HIT_RATIO})"
        )
    cached = ", ".join(f"{t['cached_tokens']}/{t['prompt_tokens']}" for t in c["turns"])
    return (
        f"long context ({c['context_tokens']} tokens, {len(c['turns'])} turns): cached/prompt {cached}; "
        f"TTFT first {c['first_ttft_ms']} ms, later median {c['later_ttft_ms_median']} ms; "
        f"lowest later hit ratio {c['later_hit_ratio_min']} (pass >= {MIN_HIT_RATIO})"
    )

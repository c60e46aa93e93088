"""Trace statistics under the papers' averaging conventions (`kvpath loadgen stats`).

Every trace: `requests` (calls), `input_mean` and `output_mean` (prompt and generated tokens per call, pooled
over calls), `ideal_hit_rate` (prompt tokens a perfect, never-evicting prefix cache would serve, over all
prompt tokens).

Trajectories (kvpath and messages traces) add DualPath Table 2's columns (brief §7.4):
  `turns`    mean turns per trajectory;
  `append`   per-trajectory mean appended tokens per turn, averaged over trajectories;
  `gen`      per-trajectory mean generated tokens per turn, averaged over trajectories;
  `total`    mean total tokens of a trajectory (all appends and generations);
  `context`  turn-weighted mean context a turn's prompt re-reads (earlier appends and generations);
and the pooled per-round means `append_pooled` / `gen_pooled` (AMPD Table 1's "per round" reading).
A trajectory's ideal hit rate counts its context as hits: hits only within a trajectory, as in DualPath.

Mooncake traces: a block is a hit when an earlier request carried the same hash id (prefix ids are chained,
so a seen id implies its whole prefix); only full blocks count, since a partial block is never cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from loadgen.lengths import Lengths, lengths_stats
from loadgen.trace import BlockTrace, MessagesTrace, Trace, TrajectoryTrace, message_text


def trajectory_trace_lengths(trace: TrajectoryTrace) -> list[Lengths]:
    return [
        (
            np.array([r.append_tokens for r in t.rounds], dtype=np.int64),
            np.array([r.gen_tokens for r in t.rounds], dtype=np.int64),
        )
        for t in trace.trajectories
    ]


def block_stats(trace: BlockTrace) -> dict[str, float]:
    inputs = np.array([r.input_tokens for r in trace.requests], dtype=np.float64)
    outputs = np.array([r.output_tokens for r in trace.requests], dtype=np.float64)
    seen: set[int] = set()
    hit_tokens = 0
    for req in trace.requests:
        full = req.input_tokens // trace.block_tokens
        for hash_id in req.hash_ids[:full]:
            if hash_id not in seen:
                break
            hit_tokens += trace.block_tokens
        seen.update(req.hash_ids)
    span_s = trace.requests[-1].arrival_s - trace.requests[0].arrival_s
    return {
        "requests": len(trace.requests),
        "input_mean": float(inputs.mean()),
        "output_mean": float(outputs.mean()),
        "input_p50": float(np.percentile(inputs, 50)),
        "input_p99": float(np.percentile(inputs, 99)),
        "output_p50": float(np.percentile(outputs, 50)),
        "max_prompt": float(inputs.max()),
        "duration_s": span_s,
        "request_rate_per_s": len(inputs) / span_s if span_s > 0 else float("nan"),
        "unique_blocks": len(seen),
        "ideal_hit_rate": hit_tokens / float(inputs.sum()),
    }


def messages_lengths(trace: MessagesTrace, count_tokens: Any, default_output_tokens: int) -> list[Lengths]:
    """Per session: append = prompt tokens beyond what the previous call sent plus its reply; gen = output."""
    out: list[Lengths] = []
    for session in trace.sessions:
        appends: list[int] = []
        gens = [
            messages_output_tokens(session.calls, i, count_tokens, default_output_tokens)
            for i in range(len(session.calls))
        ]
        previous: list[dict[str, Any]] = []
        context = 0
        for i, call in enumerate(session.calls):
            prompt = sum(count_tokens(message_text(m)) for m in call.messages)
            shared = _shared_prefix(previous, call.messages)
            reused = sum(count_tokens(message_text(m)) for m in call.messages[:shared])
            if i and shared == len(previous) and len(call.messages) > shared:
                if call.messages[shared].get("role") == "assistant":
                    reused += count_tokens(message_text(call.messages[shared]))
            appends.append(max(0, prompt - min(reused, context)))
            context = prompt + gens[i]
            previous = call.messages
        out.append((np.array(appends, dtype=np.int64), np.array(gens, dtype=np.int64)))
    return out


def messages_output_tokens(calls: Sequence[Any], index: int, count_tokens: Any, default: int) -> int:
    """Recorded output length, else the length of the reply the next call carries, else `default`."""
    call = calls[index]
    if call.output_tokens is not None:
        return int(call.output_tokens)
    if index + 1 < len(calls):
        nxt = calls[index + 1].messages
        shared = _shared_prefix(call.messages, nxt)
        if shared == len(call.messages) and len(nxt) > shared and nxt[shared].get("role") == "assistant":
            return max(1, int(count_tokens(message_text(nxt[shared]))))
    return default


def _shared_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def trace_stats(
    trace: Trace, *, count_tokens: Any = None, default_output_tokens: int = 256
) -> dict[str, Any]:
    """`stats` of any trace; messages traces count tokens with `count_tokens(text)` (default: estimate)."""
    if isinstance(trace, BlockTrace):
        return {"format": trace.format, **block_stats(trace)}
    if isinstance(trace, TrajectoryTrace):
        result: dict[str, Any] = {"format": trace.format, **lengths_stats(trajectory_trace_lengths(trace))}
        if trace.header:
            result["header"] = trace.header
        return result
    counter = count_tokens or estimate_tokens
    lengths = messages_lengths(trace, counter, default_output_tokens)
    return {
        "format": trace.format,
        "token_counts": "tokenizer" if count_tokens else "estimated",
        **lengths_stats(lengths),
    }


def estimate_tokens(text: str) -> int:
    """About four UTF-8 bytes per token, the usual figure for English BPE vocabularies."""
    return (len(text.encode()) + 3) // 4

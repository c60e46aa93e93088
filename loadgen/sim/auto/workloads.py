"""The five workloads of `kvpath bench auto` as simulated sessions (pure: seeded numpy, no I/O).

  dualpath  agent trajectories of the DualPath profile (long contexts, ~95% hits from turn 2, no tool wait):
            storage-bound when the hit KV is read from the store
  ampd      AMPD multi-round sessions (ToolBench and DuReader shapes, tool latencies between rounds,
            Poisson session arrivals), scored by SLO attainment
  pool      LV-Eval-like: long shared documents with Zipf popularity, many short questions each
  fanin     one large document held by one engine, many sub-agents appending their own suffix
  mix       all four at once on one cluster

A turn names the prefix it can hit (`prefix_key`): a session's own context (multi-turn) or a shared document.
What a tier holds of that key after the turn is `stored_after` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from loadgen.profiles import PROFILES

WORKLOADS = ("dualpath", "ampd", "pool", "fanin", "mix")
HOLDER_KEY = "fanin-doc"  # the document the fan-in holder keeps pinned


@dataclass(frozen=True, slots=True)
class Turn:
    prefix_key: str
    prompt_tokens: int
    output_tokens: int
    stored_after: int  # tokens of `prefix_key` a tier holds once this turn finished
    tool_s: float = 0.0  # wait before the session's next turn


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    workload: str
    start_s: float
    turns: tuple[Turn, ...]
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None


@dataclass(frozen=True, slots=True)
class Scale:
    """Sizes of the simulated runs (the bench's defaults; tests shrink them)."""

    agents: int = 24
    max_turns: int = 24
    ampd_sessions: int = 48
    ampd_rate: float = 8.0  # sessions per second
    pool_docs: int = 24
    pool_questions: int = 160
    pool_rate: float = 3.0
    fanin_agents: int = 32
    fanin_doc_tokens: int = 32_768
    ttft_slo_s: float = 0.3
    itl_slo_s: float = 0.025


def _multi_turn(
    sid: str, workload: str, start: float, appends: list[int], gens: list[int], tools: list[float]
) -> Session:
    turns, context = [], 0
    for a, g, t in zip(appends, gens, tools, strict=True):
        prompt = context + int(a)
        turns.append(Turn(sid, prompt, max(1, int(g)), prompt + int(g), t))
        context = prompt + int(g)
    return Session(sid, workload, start, tuple(turns))


def dualpath_sessions(scale: Scale, seed: int) -> list[Session]:
    out = []
    for i, (a, g) in enumerate(PROFILES["dualpath-32k"].lengths(scale.agents, seed)):
        n = min(len(a), scale.max_turns)
        out.append(_multi_turn(f"dp{i}", "dualpath", 0.0, list(a[:n]), list(g[:n]), [0.0] * n))
    return out


def ampd_sessions(scale: Scale, seed: int) -> list[Session]:
    rng = np.random.default_rng([seed, 11])
    starts = np.cumsum(rng.exponential(1.0 / scale.ampd_rate, scale.ampd_sessions))
    half = scale.ampd_sessions // 2
    shapes = {"toolbench": PROFILES["toolbench"].lengths(half, seed)}
    shapes["dureader"] = PROFILES["dureader"].lengths(scale.ampd_sessions - half, seed)
    out = []
    for i, (name, (a, g)) in enumerate((n, x) for n, xs in shapes.items() for x in xs):
        tool_mean = PROFILES[name].tool_mean_s
        tools = [float(x) for x in rng.exponential(tool_mean, len(a))] if tool_mean > 0 else [0.0] * len(a)
        s = _multi_turn(f"am{i}", "ampd", float(starts[i]), list(a), list(g), tools)
        out.append(replace(s, ttft_slo_s=scale.ttft_slo_s, itl_slo_s=scale.itl_slo_s))
    return out


def pool_sessions(scale: Scale, seed: int) -> list[Session]:
    rng = np.random.default_rng([seed, 12])
    doc_tokens = rng.integers(12_000, 24_000, scale.pool_docs)
    weights = 1.0 / np.arange(1, scale.pool_docs + 1)
    docs = rng.choice(scale.pool_docs, scale.pool_questions, p=weights / weights.sum())
    starts = np.cumsum(rng.exponential(1.0 / scale.pool_rate, scale.pool_questions))
    out = []
    for i, (d, start) in enumerate(zip(docs, starts, strict=True)):
        doc = int(doc_tokens[d])
        turn = Turn(f"doc{d}", doc + int(rng.integers(32, 256)), int(rng.integers(6, 20)), doc)
        out.append(Session(f"lv{i}", "pool", float(start), (turn,)))
    return out


def fanin_sessions(scale: Scale, seed: int) -> list[Session]:
    rng = np.random.default_rng([seed, 13])
    doc = scale.fanin_doc_tokens
    out = []
    for i in range(scale.fanin_agents):
        turn = Turn(HOLDER_KEY, doc + int(rng.integers(64, 512)), 64, doc)
        out.append(Session(f"fi{i}", "fanin", float(i) * 0.05, (turn,)))
    return out


def build(workload: str, scale: Scale, seed: int) -> list[Session]:
    makers = {
        "dualpath": dualpath_sessions,
        "ampd": ampd_sessions,
        "pool": pool_sessions,
        "fanin": fanin_sessions,
    }
    if workload == "mix":
        return [s for name in makers for s in makers[name](scale, seed)]
    return makers[workload](scale, seed)

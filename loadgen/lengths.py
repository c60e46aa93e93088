"""Trajectories as (append per turn, gen per turn) arrays, and their statistics (the synthesizer fits its
shapes against these; `kvpath loadgen stats` reports them for traces)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Lengths = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]  # (append per round, gen per round)


def lengths_stats(lengths: Sequence[Lengths]) -> dict[str, float]:
    """Statistics of trajectories given as (append per turn, gen per turn) arrays."""
    turns = np.array([len(a) for a, _ in lengths], dtype=np.float64)
    sum_turns = float(turns.sum())
    contexts = [np.concatenate(([0], np.cumsum(a + g)[:-1])) for a, g in lengths]
    sum_context = float(sum(c.sum() for c in contexts))
    sum_append = float(sum(a.sum() for a, _ in lengths))
    sum_gen = float(sum(g.sum() for _, g in lengths))
    return {
        "requests": int(sum_turns),
        "trajectories": len(lengths),
        "input_mean": (sum_context + sum_append) / sum_turns,
        "output_mean": sum_gen / sum_turns,
        "turns": float(turns.mean()),
        "append": float(np.mean([a.mean() for a, _ in lengths])),
        "gen": float(np.mean([g.mean() for _, g in lengths])),
        "total": float(np.mean([a.sum() + g.sum() for a, g in lengths])),
        "context": sum_context / sum_turns,
        "append_pooled": sum_append / sum_turns,
        "gen_pooled": sum_gen / sum_turns,
        "max_prompt": float(max(int(c[-1] + a[-1]) for c, (a, _) in zip(contexts, lengths, strict=True))),
        "ideal_hit_rate": sum_context / (sum_context + sum_append),
    }

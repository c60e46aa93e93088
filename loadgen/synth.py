"""Trace synthesis: seeded agent trajectories whose statistics match the published workload tables.

Two length models, both pure functions of (shape, agent count, seed):

`dualpath_lengths` (DualPath Table 2; brief §7.4). Turn counts are lognormal (stratified) and the total length
of a trajectory is independent of its turn count and clipped at MaxLen, so short trajectories take long steps:
that is what makes Table 2's per-trajectory Append mean exceed Total / Turns. Turn 1 appends a large task
prompt (this lifts Context above Total / 2), every turn generates a short tool call, and the remaining budget
is spread over the later turns' appends. Five internal parameters (turn scale and spread, gen mean, first
prompt, total) are solved by fixed-point iteration on a 2,000-trajectory reference sample so the five Table 2
means match (`fit_dualpath`, cached per target).

`ampd_lengths` (AMPD Table 1; brief §7.3). Rounds are 1 + Poisson(mean - 1) (stratified) or fixed; per-round
lengths are lognormal. Table 1's prefill length is the new tokens of a round (I1: ToolBench, HotpotQA,
DuReader) or the whole prompt of a call (I2: GAIA); in I2 later rounds append `append_mean` tool tokens and
the first prompt is sized so the mean prompt over calls hits the published value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from loadgen.lengths import Lengths, lengths_stats
from loadgen.sampling import (
    lognormal_draws,
    lognormal_params,
    normal_quantiles,
    poisson_quantiles,
    round_lengths,
    stratified_uniforms,
)

_FIT_AGENTS = 2000
_FIT_SEED = 20260226
_TOTAL_CV = 0.15
_FIRST_CV = 0.5
_GEN_CV = 0.6
_GEN_SHARE = 0.7  # generations may take at most this share of what the first prompt leaves


@dataclass(slots=True, frozen=True)
class DualPathTargets:
    """Table 2 row: MaxLen and the five means."""

    max_len: int
    turns: float
    append: float
    gen: float
    total: float
    context: float


@dataclass(slots=True, frozen=True)
class DualPathShape:
    max_len: int
    turns_mean: float
    turns_sigma: float
    gen_mean: float
    first_mean: float
    total_mean: float


@dataclass(slots=True, frozen=True)
class AmpdShape:
    rounds_mean: float
    fixed_rounds: bool
    prefill_mean: float  # Table 1 "prefill length"
    gen_mean: float
    whole_prompt: bool  # I2: the prefill length is the whole prompt of a call
    append_mean: float = 0.0  # I2: tool tokens appended by each later round
    prefill_cv: float = 0.6
    gen_cv: float = 0.8
    max_context: int = 32768


def dualpath_lengths(shape: DualPathShape, n: int, seed: int) -> list[Lengths]:
    rng = np.random.default_rng([seed, 0])
    z_turns = normal_quantiles(stratified_uniforms(n, rng))
    z_total, z_first = rng.standard_normal(n), rng.standard_normal(n)
    sig = shape.turns_sigma
    turns = np.maximum(2, np.rint(shape.turns_mean * np.exp(sig * z_turns - sig * sig / 2))).astype(np.int64)
    totals = np.minimum(shape.max_len, shape.total_mean * _lognormal_unit(z_total, _TOTAL_CV))
    firsts = np.minimum(shape.first_mean * _lognormal_unit(z_first, _FIRST_CV), 0.5 * totals)
    out: list[Lengths] = []
    for k in range(n):
        t = int(min(turns[k], totals[k] // 4))
        agent = np.random.default_rng([seed, 1, k])
        gens = shape.gen_mean * _lognormal_unit(agent.standard_normal(t), _GEN_CV)
        budget = (totals[k] - firsts[k]) * _GEN_SHARE
        if gens.sum() > budget:
            gens *= budget / gens.sum()
        gens = round_lengths(gens, 1).astype(np.float64)
        weights = agent.exponential(size=t - 1)
        appends = np.empty(t)
        appends[0] = firsts[k]
        appends[1:] = (totals[k] - firsts[k] - gens.sum()) * weights / weights.sum()
        out.append(_fit_max_len(round_lengths(appends, 1), gens.astype(np.int64), shape.max_len))
    return out


def _fit_max_len(appends: npt.NDArray[np.int64], gens: npt.NDArray[np.int64], max_len: int) -> Lengths:
    """Take what rounding put over `max_len` off the largest append (or end the trajectory earlier)."""
    excess = int(appends.sum() + gens.sum()) - max_len
    if excess > 0:
        largest = int(np.argmax(appends))
        appends[largest] = max(1, int(appends[largest]) - excess)
    return truncate(appends, gens, max_len)


def _lognormal_unit(z: npt.NDArray[np.float64], cv: float) -> npt.NDArray[np.float64]:
    mu, sigma = lognormal_params(1.0, cv)
    return np.exp(mu + sigma * z)


@functools.lru_cache(maxsize=16)
def fit_dualpath(targets: DualPathTargets, iterations: int = 40) -> DualPathShape:
    """The shape whose reference sample reproduces `targets` (all five means within 0.1 %)."""
    t = targets
    shape = DualPathShape(t.max_len, t.turns, 0.7, t.gen, max(1.0, 2 * t.context - t.total), t.total)
    for _ in range(iterations):
        s = lengths_stats(dualpath_lengths(shape, _FIT_AGENTS, _FIT_SEED))
        errors = [s[k] / getattr(t, k) - 1 for k in ("turns", "append", "gen", "total", "context")]
        if max(abs(e) for e in errors) < 1e-3:
            return shape
        shape = replace(
            shape,
            turns_mean=shape.turns_mean * t.turns / s["turns"],
            turns_sigma=shape.turns_sigma * (t.append / s["append"]) ** 0.7,
            gen_mean=shape.gen_mean * t.gen / s["gen"],
            first_mean=max(1.0, shape.first_mean + 1.5 * (t.context - s["context"])),
            total_mean=shape.total_mean * t.total / s["total"],
        )
    raise ValueError(f"cannot fit a trajectory model to {targets} (errors {errors})")


def ampd_lengths(shape: AmpdShape, n: int, seed: int) -> list[Lengths]:
    rng = np.random.default_rng([seed, 0])
    u = stratified_uniforms(n, rng)
    if shape.fixed_rounds:
        rounds = np.full(n, round(shape.rounds_mean), dtype=np.int64)
    else:
        rounds = 1 + poisson_quantiles(u, shape.rounds_mean - 1)
    first_mean = ampd_first_mean(shape) if shape.whole_prompt else shape.prefill_mean
    later_mean = shape.append_mean if shape.whole_prompt else shape.prefill_mean
    out: list[Lengths] = []
    for r in rounds:
        appends = lognormal_draws(rng, later_mean, shape.prefill_cv, int(r))
        appends[0] = lognormal_draws(rng, first_mean, shape.prefill_cv, 1)[0]
        gens = lognormal_draws(rng, shape.gen_mean, shape.gen_cv, int(r))
        out.append(truncate(round_lengths(appends, 1), round_lengths(gens, 1), shape.max_context))
    return out


def ampd_first_mean(shape: AmpdShape) -> float:
    """I2: the first prompt so that the call-weighted mean prompt equals `prefill_mean`.

    With T rounds, call r's prompt is first + (r-1)(append + gen); summed over calls and divided by E[T] the
    mean is first + (append + gen) E[T(T-1)] / (2 E[T]). For T = 1 + Poisson(lam), E[T(T-1)] = lam(2+lam).
    """
    lam = shape.rounds_mean - 1
    growth = lam / 2 if shape.fixed_rounds else lam * (lam + 2) / (2 * (lam + 1))
    first = shape.prefill_mean - (shape.append_mean + shape.gen_mean) * growth
    if first <= 0:
        raise ValueError(
            f"AMPD shape cannot reach prefill mean {shape.prefill_mean}: first prompt {first:.0f}"
        )
    return first


def truncate(appends: npt.NDArray[np.int64], gens: npt.NDArray[np.int64], max_len: int) -> Lengths:
    """Keep the leading turns whose prompt plus generation fits in `max_len` (the trajectory ends there).

    A first turn that does not fit alone is clipped to fit, so every trajectory keeps at least one turn.
    """
    ends = np.cumsum(appends + gens)
    keep = int(np.searchsorted(ends, max_len, side="right"))
    if keep == 0:
        first_gen = int(min(int(gens[0]), max(1, max_len // 8)))
        return np.array([max(1, max_len - first_gen)], dtype=np.int64), np.array([first_gen], dtype=np.int64)
    return appends[:keep], gens[:keep]


def scale_lengths(lengths: Lengths, factor: float) -> Lengths:
    """Multiply every length by `factor` (CPU runs); a non-empty length stays at least one token."""
    if factor == 1.0:
        return lengths
    appends, gens = lengths
    scaled_a = np.where(appends > 0, np.maximum(1, np.rint(appends * factor)), 0).astype(np.int64)
    scaled_g = np.maximum(1, np.rint(gens * factor)).astype(np.int64)
    return scaled_a, scaled_g


def tool_latencies(rng: np.random.Generator, mean_s: float, cv: float, rounds: int) -> list[float]:
    """Tool latency after each round but the last (all zero when the profile has none)."""
    if mean_s <= 0 or rounds <= 1:
        return [0.0] * rounds
    draws = lognormal_draws(rng, mean_s, cv, rounds - 1)
    return [*(round(float(x), 4) for x in draws), 0.0]

"""Named workload profiles (`kvpath loadgen synth --profile NAME`) and the synthesizer that writes them.

Each profile carries the published means it reproduces, keyed by the `stats` field that measures them:
DualPath Table 2 (brief §7.4) for `dualpath-32k|48k|64k` and AMPD Table 1 (brief §1.4, §7.3) for
`toolbench|gaia|hotpotqa|dureader`. AMPD's "prefill length" is the per-round new tokens (`append_pooled`) for
ToolBench, HotpotQA and DuReader (reading I1) and the whole prompt of a call (`input_mean`) for GAIA (I2,
the only reading that fits GAIA in a 32K window). Tool latencies are not published: DualPath replays with
none; AMPD's agents get a lognormal with mean 1 s and its RAG traces 0.2 s (brief §7.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.content import mix
from loadgen.synth import (
    AmpdShape,
    DualPathTargets,
    Lengths,
    ampd_lengths,
    dualpath_lengths,
    fit_dualpath,
    scale_lengths,
    tool_latencies,
    truncate,
)
from loadgen.trace import Round, Trajectory, TrajectoryTrace

SEED_MASK = (1 << 63) - 1


@dataclass(slots=True, frozen=True)
class Profile:
    name: str
    source: str
    published: dict[str, float]
    dualpath: DualPathTargets | None = None
    ampd: AmpdShape | None = None
    tool_mean_s: float = 0.0
    tool_cv: float = 1.0
    notes: str = field(default="")

    def lengths(self, n: int, seed: int) -> list[Lengths]:
        if self.dualpath is not None:
            return dualpath_lengths(fit_dualpath(self.dualpath), n, seed)
        assert self.ampd is not None
        return ampd_lengths(self.ampd, n, seed)


def _dualpath(name: str, row: DualPathTargets) -> Profile:
    published = {"turns": row.turns, "append": row.append, "gen": row.gen, "total": row.total}
    published["context"] = row.context
    return Profile(name, f"DualPath Table 2, MaxLen {row.max_len // 1024}K", published, dualpath=row)


def _ampd(name: str, shape: AmpdShape, tool_mean_s: float) -> Profile:
    prefill_key = "input_mean" if shape.whole_prompt else "append_pooled"
    published = {"turns": shape.rounds_mean, prefill_key: shape.prefill_mean, "output_mean": shape.gen_mean}
    reading = "I2 (prefill = whole prompt)" if shape.whole_prompt else "I1 (prefill = new tokens per round)"
    return Profile(name, f"AMPD Table 1, {reading}", published, ampd=shape, tool_mean_s=tool_mean_s)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        _dualpath("dualpath-32k", DualPathTargets(32768, 60, 608, 148, 28639, 17183)),
        _dualpath("dualpath-48k", DualPathTargets(49152, 106, 474, 172, 42607, 25120)),
        _dualpath("dualpath-64k", DualPathTargets(65536, 157, 429, 176, 55958, 32721)),
        _ampd("toolbench", AmpdShape(3.96, False, 703.79, 50.39, False), 1.0),
        _ampd("gaia", AmpdShape(11.32, False, 6161.02, 528.76, True, append_mean=200.0), 1.0),
        _ampd("hotpotqa", AmpdShape(3, True, 1569.8, 80.03, False), 0.2),
        _ampd("dureader", AmpdShape(3, True, 3081.23, 150.10, False), 0.2),
    )
}


@dataclass(slots=True, frozen=True)
class SynthOptions:
    agents: int
    seed: int = 0
    length_scale: float = 1.0  # multiply every length (CPU runs)
    max_context: int | None = None  # end a trajectory before the turn whose prompt + output exceeds this
    base_trajectories: int = 0  # > 0: agents replay this many base trajectories behind a random first round
    first_round_tokens: int = 64  # length of that random first round (it generates one token)
    tool_scale: float = 1.0  # multiply tool latencies (0: none)


def synthesize(profile: Profile, opts: SynthOptions) -> TrajectoryTrace:
    """`opts.agents` trajectories of `profile`; the same options and seed give the same trace."""
    if opts.agents < 1:
        raise ValueError(f"agents must be >= 1, got {opts.agents}")
    base_count = opts.base_trajectories or opts.agents
    base = profile.lengths(base_count, opts.seed)
    rng = np.random.default_rng([opts.seed, 7])
    trajectories = []
    for i in range(opts.agents):
        b = int(rng.integers(base_count)) if opts.base_trajectories else i
        appends, gens = scale_lengths(base[b], opts.length_scale)
        round_seeds: list[int | None] = [None] * len(appends)
        if opts.base_trajectories:
            # shared base content behind a per-agent random round: no two agents share a prefix
            round_seeds = [mix(opts.seed, 1, b, j) & SEED_MASK for j in range(len(appends))]
            first = max(1, opts.first_round_tokens)
            appends, gens = np.concatenate(([first], appends)), np.concatenate(([1], gens))
            round_seeds.insert(0, None)
        if opts.max_context:
            appends, gens = truncate(appends, gens, opts.max_context)
        tools = tool_latencies(rng, profile.tool_mean_s * opts.tool_scale, profile.tool_cv, len(appends))
        rounds = [
            Round(int(a), int(g), t, s) for a, g, t, s in zip(appends, gens, tools, round_seeds, strict=False)
        ]
        trajectories.append(Trajectory(f"a{i:05d}", mix(opts.seed, 2, i) & SEED_MASK, rounds))
    return TrajectoryTrace(trajectories, header=_header(profile, opts))


def _header(profile: Profile, opts: SynthOptions) -> dict[str, Any]:
    return {
        "kvpath_trace": 1,
        "profile": profile.name,
        "source": profile.source,
        "published": profile.published,
        "agents": opts.agents,
        "seed": opts.seed,
        "length_scale": opts.length_scale,
        "max_context": opts.max_context,
        "base_trajectories": opts.base_trajectories,
        "tool_scale": opts.tool_scale,
    }

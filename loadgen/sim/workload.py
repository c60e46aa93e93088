"""What the simulated agents do: per agent its rounds (append, generate, tool pause) and its arrival time.

Traces come from `loadgen.profiles` (`synthesize` with `base_trajectories`: every agent replays a base
trajectory behind a random first round, as the paper makes 1K-48K agents from 500 trajectories). The
simulator only needs lengths, so past `SYNTH_CAP` agents the synthesized plans repeat (agent i uses plan
i mod SYNTH_CAP): statistically the same as drawing more, and agents never share KV in the simulator anyway.
Hits follow brief 6.2: a turn hits its whole context rounded down to whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.profiles import PROFILES, SynthOptions, synthesize
from loadgen.sim.config import SimConfig
from loadgen.synth import truncate
from loadgen.trace import TrajectoryTrace
from shared.errors import ConfigError

SYNTH_CAP = 4096


@dataclass(frozen=True, slots=True)
class AgentPlan:
    """One agent's rounds: tokens appended, tokens generated, tool pause after the round."""

    appends: tuple[int, ...]
    gens: tuple[int, ...]
    tool_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (len(self.appends) == len(self.gens) == len(self.tool_s) >= 1):
            raise ConfigError("an agent plan needs one append, gen and tool pause per round, and a round")
        if min(self.appends) < 0 or self.appends[0] < 1 or min(self.gens) < 1:
            raise ConfigError("an agent plan needs appends >= 0 (the first >= 1) and gens >= 1")

    @property
    def num_turns(self) -> int:
        return len(self.appends)

    @property
    def total_tokens(self) -> int:
        return sum(self.appends) + sum(self.gens)


@dataclass(frozen=True, slots=True)
class Workload:
    plans: tuple[AgentPlan, ...]
    arrivals_s: tuple[float, ...]  # one per plan, in order

    def __post_init__(self) -> None:
        if len(self.plans) != len(self.arrivals_s) or not self.plans:
            raise ConfigError("a workload needs at least one agent and one arrival time per agent")

    @property
    def num_requests(self) -> int:
        return sum(p.num_turns for p in self.plans)


def hit_tokens(context_tokens: int, block_size: int) -> int:
    """Stored prefix of a turn: its context (earlier appends and generations) in whole blocks."""
    return context_tokens // block_size * block_size


def plans_from_trace(
    trace: TrajectoryTrace, max_len: int = 0, append_scale: float = 1.0, gen_scale: float = 1.0
) -> list[AgentPlan]:
    """Agent plans of a trajectory trace; scaled lengths end the trajectory before it passes `max_len`."""
    plans = []
    for trajectory in trace.trajectories:
        appends = np.array([r.append_tokens for r in trajectory.rounds], dtype=np.int64)
        gens = np.array([r.gen_tokens for r in trajectory.rounds], dtype=np.int64)
        if append_scale != 1.0 or gen_scale != 1.0:
            appends = np.maximum(np.rint(appends * append_scale), np.minimum(appends, 1)).astype(np.int64)
            gens = np.maximum(1, np.rint(gens * gen_scale)).astype(np.int64)
            if max_len:
                appends, gens = truncate(appends, gens, max_len)
        tools = tuple(float(r.tool_latency_s) for r in trajectory.rounds[: len(appends)])
        plans.append(AgentPlan(tuple(int(a) for a in appends), tuple(int(g) for g in gens), tools))
    return plans


def poisson_arrivals(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of `rate_per_s` over [0, duration_s)."""
    rng = np.random.default_rng([seed, 31])
    times: list[float] = []
    t = float(rng.exponential(1.0 / rate_per_s))
    while t < duration_s:
        times.append(t)
        t += float(rng.exponential(1.0 / rate_per_s))
    return times


def build_workload(config: SimConfig) -> Workload:
    """The agents of a run: `config.agents` at t=0 (offline) or Poisson arrivals at `config.aps` (online)."""
    if config.mode == "online":
        arrivals = poisson_arrivals(config.aps, config.duration_s, config.seed)
        if not arrivals:
            raise ConfigError(f"no agent arrives within duration_s={config.duration_s} at aps={config.aps}")
    else:
        arrivals = [0.0] * config.agents
    profile = PROFILES[f"dualpath-{config.mal}"]
    assert profile.dualpath is not None
    opts = SynthOptions(
        agents=min(len(arrivals), SYNTH_CAP),
        seed=config.seed,
        base_trajectories=config.base_trajectories,
        first_round_tokens=config.first_round_tokens,
    )
    plans = plans_from_trace(
        synthesize(profile, opts), profile.dualpath.max_len, config.append_scale, config.gen_scale
    )
    return Workload(tuple(plans[i % len(plans)] for i in range(len(arrivals))), tuple(arrivals))

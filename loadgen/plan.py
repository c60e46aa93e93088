"""From a loaded trace and the replay options to the session scripts the replayer runs.

`SessionSource.make(i)` builds session i of the selected slice (`--skip`, `--limit`); an index past the
slice cycles through it again with a fresh content salt, so every extra agent has its own prefixes (the
paper's way of running more agents than trajectories). Arrival times come from the trace (scaled by
`time_scale`; a cycle starts after the previous one ends) or from a seeded Poisson process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from loadgen.config import ReplayConfig
from loadgen.content import Vocab, mix
from loadgen.sessions import (
    BlockCacheModel,
    BlockScript,
    MessagesScript,
    RenderOptions,
    SessionScript,
    TrajectoryScript,
)
from loadgen.stats import estimate_tokens, messages_output_tokens
from loadgen.trace import BlockTrace, MessagesTrace, Trace, TraceFormatError, Trajectory, TrajectoryTrace
from shared.errors import ConfigError

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class SessionSource:
    size: int
    calls_per_pass: int  # requests in one pass over the slice (progress total)
    _build: Callable[[int, RenderOptions, int], SessionScript]
    _arrivals: Sequence[float | None]
    opts: RenderOptions

    def make(self, index: int) -> SessionScript:
        cycle, base = divmod(index, self.size)
        opts = self.opts if cycle == 0 else dataclasses.replace(self.opts, salt=mix(self.opts.salt, cycle))
        return self._build(base, opts, cycle)

    def trace_arrival_s(self, index: int) -> float | None:
        cycle, base = divmod(index, self.size)
        arrival = self._arrivals[base]
        if arrival is None:
            return None
        known = [a for a in self._arrivals if a is not None]
        period = (max(known) - min(known)) * (1 + 1 / max(1, len(known))) if len(known) > 1 else 1.0
        return arrival + cycle * period


def render_options(config: ReplayConfig, salt: int) -> RenderOptions:
    return RenderOptions(
        endpoint=config.endpoint,
        prompt_format=config.prompt_format,
        text_unit=config.text_unit,
        history=config.history,
        vocab=Vocab(config.vocab_size, config.min_token_id),
        max_context=config.max_context,
        length_scale=config.length_scale,
        salt=salt,
    )


def session_source(trace: Trace, config: ReplayConfig, salt: int, run_tag: str) -> SessionSource:
    opts = render_options(config, salt)
    end = config.skip + config.limit if config.limit else None
    scale = config.time_scale

    def sid(name: str, cycle: int) -> str:
        return f"{run_tag}-{name}" + (f"~{cycle}" if cycle else "")

    if isinstance(trace, TrajectoryTrace):
        trajs = _slice(trace.trajectories, config.skip, end)
        traj_arrivals = [None if t.arrival_s is None else t.arrival_s * scale for t in trajs]

        def build_traj(i: int, o: RenderOptions, cycle: int) -> SessionScript:
            t = _scaled(trajs[i], config.length_scale, config.max_turns)
            return TrajectoryScript(t, sid(t.agent_id, cycle), o)

        calls = sum(min(len(t.rounds), config.max_turns or len(t.rounds)) for t in trajs)
        return SessionSource(len(trajs), calls, build_traj, traj_arrivals, opts)
    if isinstance(trace, BlockTrace):
        reqs = _slice(trace.requests, config.skip, end)
        cache = BlockCacheModel()
        block_arrivals = [r.arrival_s * scale for r in reqs]

        def build_block(i: int, o: RenderOptions, cycle: int) -> SessionScript:
            name = sid(f"r{config.skip + i}", cycle)
            return BlockScript(reqs[i], name, o, cache=cache, cycle=cycle, block_tokens=trace.block_tokens)

        return SessionSource(len(reqs), len(reqs), build_block, block_arrivals, opts)
    return _messages_source(trace, config, opts, end, sid)


def _messages_source(
    trace: MessagesTrace,
    config: ReplayConfig,
    opts: RenderOptions,
    end: int | None,
    sid: Callable[[str, int], str],
) -> SessionSource:
    if config.endpoint != "chat":
        raise ConfigError(
            "messages traces replay through the chat endpoint: pass --endpoint chat", param="endpoint"
        )
    sessions = _slice(trace.sessions, config.skip, end)
    outputs = [
        [
            messages_output_tokens(s.calls, i, estimate_tokens, config.default_output_tokens)
            for i in range(len(s.calls))
        ]
        for s in sessions
    ]
    arrivals = [s.calls[0].arrival_s for s in sessions]
    scaled = [None if a is None else a * config.time_scale for a in arrivals]

    turns = config.max_turns

    def build(i: int, o: RenderOptions, cycle: int) -> SessionScript:
        del o
        session = (
            sessions[i] if not turns else dataclasses.replace(sessions[i], calls=sessions[i].calls[:turns])
        )
        return MessagesScript(session, sid(session.session_id, cycle), outputs[i], scaled[i])

    calls = sum(min(len(s.calls), turns or len(s.calls)) for s in sessions)
    return SessionSource(len(sessions), calls, build, scaled, opts)


def _slice(items: Sequence[T], skip: int, end: int | None) -> list[T]:
    chosen = list(items[skip:end])
    if not chosen:
        raise TraceFormatError(f"--skip {skip} leaves no sessions of the {len(items)} in the trace")
    return chosen


def _scaled(traj: Trajectory, factor: float, max_turns: int = 0) -> Trajectory:
    """The first `max_turns` rounds (0: all), appends and generations multiplied by `factor` (explicit ids
    are kept)."""
    if max_turns and len(traj.rounds) > max_turns:
        traj = dataclasses.replace(traj, rounds=traj.rounds[:max_turns])
    if factor == 1.0:
        return traj
    rounds = [
        dataclasses.replace(
            r,
            append_tokens=r.append_tokens
            if r.append_ids or r.append_tokens == 0
            else max(1, round(r.append_tokens * factor)),
            gen_tokens=max(1, round(r.gen_tokens * factor)),
        )
        for r in traj.rounds
    ]
    return dataclasses.replace(traj, rounds=rounds)


def poisson_arrivals(rate_per_s: float, seed: int) -> Callable[[int], float]:
    """Arrival time of agent i for a Poisson process (cached cumulative exponential gaps)."""
    rng = np.random.default_rng([seed, 99])
    times: list[float] = [0.0]

    def at(index: int) -> float:
        while len(times) <= index:
            times.append(times[-1] + float(rng.exponential(1.0 / rate_per_s)))
        return times[index]

    return at

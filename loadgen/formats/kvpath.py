"""kvpath JSONL trajectories: one agent per line, an optional header line first.

    {"kvpath_trace": 1, "profile": "dualpath-32k", "seed": 0, ...}            optional header (metadata)
    {"agent": "a0", "seed": 17, "arrival_s": 0.0,
     "rounds": [{"append": 608, "gen": 148, "tool_s": 0.0, "seed": 5}, ...]}

Per round: `append` is a token count (>= 1 in the first round, >= 0 after) or an explicit list of token ids;
`gen` (>= 1) the tokens to generate; optional `tool_s` the tool latency after the round (seconds) and `seed`
the content key of its appended tokens. Per agent: `agent` (id, unique), optional `seed` (content key;
default: the line number) and `arrival_s` (online arrival time; default: drawn by the replayer).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadgen.formats.jsonl import LineReader, read_lines, write_lines
from loadgen.trace import Round, TraceFormatError, Trajectory, TrajectoryTrace

HEADER_KEY = "kvpath_trace"
VERSION = 1


def load(path: str | Path) -> TrajectoryTrace:
    trajectories: list[Trajectory] = []
    header: dict[str, Any] = {}
    seen: dict[str, int] = {}
    for reader in read_lines(path):
        if HEADER_KEY in reader.obj:
            if trajectories or header:
                raise reader.fail(f"the {HEADER_KEY!r} header must be the first line")
            if reader.obj[HEADER_KEY] != VERSION:
                raise reader.fail(f"unsupported {HEADER_KEY} version {reader.obj[HEADER_KEY]!r}")
            header = dict(reader.obj)
            continue
        traj = _trajectory(reader)
        if traj.agent_id in seen:
            raise reader.fail(
                f"agent {traj.agent_id!r} already defined on line {seen[traj.agent_id]}", "agent"
            )
        seen[traj.agent_id] = reader.line
        trajectories.append(traj)
    if not trajectories:
        raise TraceFormatError("no trajectories in trace", path=str(path))
    return TrajectoryTrace(trajectories, header)


def _trajectory(reader: LineReader) -> Trajectory:
    agent = reader.str_field("agent")
    seed = reader.int_field("seed") if reader.has("seed") else reader.line
    arrival = reader.float_field("arrival_s") if reader.has("arrival_s") else None
    items = reader.list_field("rounds")
    if not items:
        raise reader.fail("field 'rounds' must not be empty", "rounds")
    rounds = [_round(reader, i, item) for i, item in enumerate(items)]
    return Trajectory(agent, seed, rounds, arrival)


def _round(reader: LineReader, index: int, item: Any) -> Round:
    where = f"round {index}: "
    if not isinstance(item, dict):
        raise reader.fail(f"{where}must be an object, got {type(item).__name__}", "rounds")
    ids: tuple[int, ...] | None = None
    if isinstance(item.get("append"), list):
        ids = reader.int_list("append", where=where, obj=item)
        append = len(ids)
    else:
        append = reader.int_field("append", minimum=0, where=where, obj=item)
    if index == 0 and append < 1:
        raise reader.fail(f"{where}the first round must append at least one token", "append")
    gen = reader.int_field("gen", minimum=1, where=where, obj=item)
    tool = reader.float_field("tool_s", default=0.0, where=where, obj=item)
    seed = reader.int_field("seed", where=where, obj=item) if item.get("seed") is not None else None
    return Round(append, gen, tool, seed, ids)


def dump(path: str | Path, trace: TrajectoryTrace) -> int:
    """Write `trace` (header first when it has one); returns the number of agents written."""

    def lines() -> Iterator[dict[str, Any]]:
        if trace.header:
            yield {HEADER_KEY: VERSION, **{k: v for k, v in trace.header.items() if k != HEADER_KEY}}
        for traj in trace.trajectories:
            yield trajectory_json(traj)

    return write_lines(path, lines()) - (1 if trace.header else 0)


def trajectory_json(traj: Trajectory) -> dict[str, Any]:
    obj: dict[str, Any] = {"agent": traj.agent_id, "seed": traj.seed}
    if traj.arrival_s is not None:
        obj["arrival_s"] = traj.arrival_s
    obj["rounds"] = [_round_json(r) for r in traj.rounds]
    return obj


def _round_json(r: Round) -> dict[str, Any]:
    obj: dict[str, Any] = {"append": list(r.append_ids) if r.append_ids is not None else r.append_tokens}
    obj["gen"] = r.gen_tokens
    if r.tool_latency_s:
        obj["tool_s"] = round(r.tool_latency_s, 6)
    if r.seed is not None:
        obj["seed"] = r.seed
    return obj

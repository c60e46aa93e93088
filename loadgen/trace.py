"""The in-memory trace model shared by the readers, the synthesizer, `stats` and replay.

Three shapes of workload, one class each:
  `TrajectoryTrace`  closed-loop agents: each round appends tokens, generates tokens, then waits for a tool;
  `BlockTrace`       independent requests described by prefix block hashes (Mooncake);
  `MessagesTrace`    recorded OpenAI chat calls, grouped into sessions (the cumulative messages of each call).
Lengths are token counts. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidRequestError

MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(InvalidRequestError):
    """A trace file that does not match its format; the message names the file, line and field."""

    code = "invalid_trace"

    def __init__(self, message: str, *, path: str = "", line: int | None = None, param: str | None = None):
        where = path if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {message}" if where else message, param=param)
        self.path = path
        self.line = line


@dataclass(slots=True, frozen=True)
class Round:
    """One agent turn: `append_tokens` new prompt tokens, then `gen_tokens` generated, then a tool call.

    `seed` keys the content of the appended tokens (None: derived from the agent seed and the round index);
    `append_ids` carries explicit token ids instead of synthetic ones.
    """

    append_tokens: int
    gen_tokens: int
    tool_latency_s: float = 0.0
    seed: int | None = None
    append_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class Trajectory:
    """One agent: its rounds run back to back, each prompt extending the previous prompt and output."""

    agent_id: str
    seed: int
    rounds: list[Round]
    arrival_s: float | None = None

    def total_tokens(self) -> int:
        return sum(r.append_tokens + r.gen_tokens for r in self.rounds)


@dataclass(slots=True)
class TrajectoryTrace:
    trajectories: list[Trajectory]
    header: dict[str, Any] = field(default_factory=dict)
    format: str = "kvpath"


@dataclass(slots=True, frozen=True)
class BlockRequest:
    """One Mooncake-style request: its prompt is the concatenation of the blocks named by `hash_ids`."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True)
class BlockTrace:
    requests: list[BlockRequest]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    format: str = "mooncake"


@dataclass(slots=True)
class MessagesCall:
    """One recorded chat call: the whole message list sent, and how many tokens it generated."""

    messages: list[dict[str, Any]]
    output_tokens: int | None = None
    tool_latency_s: float = 0.0
    arrival_s: float | None = None


@dataclass(slots=True)
class MessagesSession:
    session_id: str
    calls: list[MessagesCall]


@dataclass(slots=True)
class MessagesTrace:
    sessions: list[MessagesSession]
    format: str = "messages"


Trace = TrajectoryTrace | BlockTrace | MessagesTrace


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message whose content is a string or a list of OpenAI content parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""

"""OpenAI-messages sessions: one recorded chat call per line, the cumulative messages it sent.

    {"session": "s1", "messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "output_tokens": 120, "tool_s": 0.4, "arrival_s": 0.0}

`session` groups the calls of one agent (in file order); `messages` is the full list the call sent (content a
string or a list of text parts); optional `output_tokens` (>= 1) the length it generated (default: the length
of the assistant message the session's next call carries, else the replayer's default), `tool_s` the tool
latency after the call and `arrival_s` (seconds, first call of a session) its online arrival time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadgen.formats.jsonl import LineReader, read_lines
from loadgen.trace import MessagesCall, MessagesSession, MessagesTrace, TraceFormatError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def load(path: str | Path) -> MessagesTrace:
    sessions: dict[str, MessagesSession] = {}
    for reader in read_lines(path):
        session_id = reader.str_field("session") if reader.has("session") else reader.str_field("session_id")
        call = MessagesCall(
            messages=_messages(reader),
            output_tokens=_output_tokens(reader),
            tool_latency_s=reader.float_field("tool_s", default=0.0),
            arrival_s=reader.float_field("arrival_s") if reader.has("arrival_s") else None,
        )
        sessions.setdefault(session_id, MessagesSession(session_id, [])).calls.append(call)
    if not sessions:
        raise TraceFormatError("no calls in trace", path=str(path))
    return MessagesTrace(list(sessions.values()))


def _output_tokens(reader: LineReader) -> int | None:
    for key in ("output_tokens", "max_tokens"):
        if reader.has(key):
            return reader.int_field(key, minimum=1)
    return None


def _messages(reader: LineReader) -> list[dict[str, Any]]:
    items = reader.list_field("messages")
    if not items:
        raise reader.fail("field 'messages' must not be empty", "messages")
    for i, msg in enumerate(items):
        where = f"messages[{i}]: "
        if not isinstance(msg, dict):
            raise reader.fail(f"{where}must be an object, got {type(msg).__name__}", "messages")
        if msg.get("role") not in ROLES:
            raise reader.fail(
                f"{where}role must be one of {sorted(ROLES)}, got {msg.get('role')!r}", "messages"
            )
        content = msg.get("content")
        if content is None and msg.get("role") == "assistant" and msg.get("tool_calls"):
            continue
        if not isinstance(content, str | list):
            raise reader.fail(f"{where}content must be a string or a list of parts", "messages")
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise reader.fail(f"{where}content parts must be objects", "messages")
    return items

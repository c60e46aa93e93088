"""Trace file formats: `kvpath` trajectories, `mooncake` block-hash requests, `messages` chat sessions.

`load_trace(path, fmt)` reads any of them (fmt None or "auto": detected from the first line) and raises
`TraceFormatError` naming file:line:field on the first malformed line.
"""

from __future__ import annotations

from pathlib import Path

from loadgen.formats import kvpath, messages, mooncake
from loadgen.formats.jsonl import first_object
from loadgen.trace import Trace, TraceFormatError

FORMATS = ("kvpath", "mooncake", "messages")


def detect_format(path: str | Path) -> str:
    obj = first_object(path)
    if obj is None:
        raise TraceFormatError("trace is empty", path=str(path))
    if kvpath.HEADER_KEY in obj or "rounds" in obj:
        return "kvpath"
    if "hash_ids" in obj or "input_length" in obj:
        return "mooncake"
    if "messages" in obj:
        return "messages"
    raise TraceFormatError(
        f"cannot tell the format from the first line (keys {sorted(obj)}); pass --format {'|'.join(FORMATS)}",
        path=str(path),
        line=1,
    )


def load_trace(path: str | Path, fmt: str | None = None) -> Trace:
    fmt = detect_format(path) if fmt in (None, "", "auto") else fmt
    if fmt == "kvpath":
        return kvpath.load(path)
    if fmt == "mooncake":
        return mooncake.load(path)
    if fmt == "messages":
        return messages.load(path)
    raise TraceFormatError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}", path=str(path))

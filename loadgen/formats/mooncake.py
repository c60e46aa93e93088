"""Mooncake-style request traces (FAST'25 release): one request per line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2913, 2914]}

`timestamp` is the arrival in milliseconds from the start; `hash_ids` name the prompt's blocks of 512 tokens
(identical ids at the same positions mean a shared prefix; the last block may be partial), so
`len(hash_ids) == ceil(input_length / 512)`. Requests are returned in arrival order (stable).
"""

from __future__ import annotations

from pathlib import Path

from loadgen.formats.jsonl import read_lines
from loadgen.trace import MOONCAKE_BLOCK_TOKENS, BlockRequest, BlockTrace, TraceFormatError


def load(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> BlockTrace:
    requests: list[BlockRequest] = []
    for reader in read_lines(path):
        timestamp_ms = reader.float_field("timestamp")
        input_tokens = reader.int_field("input_length", minimum=1)
        output_tokens = reader.int_field("output_length", minimum=1)
        hash_ids = reader.int_list("hash_ids")
        expected = -(-input_tokens // block_tokens)
        if len(hash_ids) != expected:
            raise reader.fail(
                f"input_length {input_tokens} needs {expected} hash_ids of {block_tokens} tokens, "
                f"got {len(hash_ids)}",
                "hash_ids",
            )
        requests.append(BlockRequest(timestamp_ms / 1000.0, input_tokens, output_tokens, hash_ids))
    if not requests:
        raise TraceFormatError("no requests in trace", path=str(path))
    requests.sort(key=lambda r: r.arrival_s)
    return BlockTrace(requests, block_tokens)

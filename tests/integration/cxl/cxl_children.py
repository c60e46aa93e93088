"""Child processes of the CXL-RPC process tests (rpc_child.py), read one JSON line at a time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

HELPER = Path(__file__).with_name("rpc_child.py")
ROOT = Path(__file__).resolve().parents[3]

Child = asyncio.subprocess.Process


@asynccontextmanager
async def child(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[Child]:
    """rpc_child.py with `args` (and `env` added to ours); on exit its stdin is closed (a server's cue to
    stop), then it is killed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HELPER),
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    try:
        yield proc
    finally:
        if proc.returncode is None and proc.stdin is not None:
            proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10)


async def read_json(proc: Child, timeout_s: float = 30) -> Any:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    assert line, f"child exited (rc={proc.returncode}) without answering"
    return json.loads(line)


async def read_until(proc: Child, key: str, timeout_s: float = 30) -> Any:
    """The first JSON line of `proc` that has `key` (earlier lines are skipped)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        msg = await read_json(proc, max(0.01, deadline - loop.time()))
        if key in msg:
            return msg

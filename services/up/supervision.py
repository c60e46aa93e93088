"""Pieces of `kvpath up`'s supervision: the restart policy, a supervised child, log tails, atomic status
files."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from services.up.forked import ForkedService
from services.up.topology import ProcessSpec
from shared.protocol import ServiceInfo


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if `kvpath up` dies, so nothing is orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    """When a child that exited is started again: after `initial_backoff_s`, doubling with every restart
    inside the window up to `max_backoff_s`; never when it exited more than `max_restarts` times within the
    last `window_s` (a crash loop: restarting would only hide it)."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 60.0

    def backoff_s(self, exits: list[float], now: float) -> float | None:
        """Seconds to wait before the next start, given the child's exit times (the last one just now);
        None: give up."""
        recent = [t for t in exits if now - t <= self.window_s]
        if len(recent) > self.max_restarts:
            return None
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, len(recent) - 1))


@dataclass(slots=True)
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes] | ForkedService
    log_path: str
    exits: list[float] = field(default_factory=list)  # monotonic times it exited
    restarts: int = 0
    last_exit_code: int | None = None
    restart_at: float | None = None  # monotonic time of its scheduled restart


def tail(path: str, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def all_healthy(http: aiohttp.ClientSession, services: list[ServiceInfo], num_engines: int) -> bool:
    """Every service answers /health with 200, and the router already sees every engine's load reports."""
    for info in services:
        try:
            async with http.get(f"{info.http_url}/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                if resp.status != 200:
                    return False
                if info.service_kind == "router" and (await resp.json()).get("engines", 0) < num_engines:
                    return False
        except (aiohttp.ClientError, TimeoutError):
            return False
    return True

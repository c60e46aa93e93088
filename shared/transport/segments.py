"""Names of the receiver's shared-memory segments, and the sweep of segments left by dead receivers.

A receiver killed with SIGKILL cannot unlink its segments (DE buffers: gigabytes of /dev/shm). Names carry
the owner's pid and pid namespace, `kvpath-rx-<pidns>-<pid>-<uid>-<what>`, so a later receiver on the same
/dev/shm sweeps those whose owner is gone. Only names from its own pid namespace: a pid from another
namespace (another container sharing /dev/shm) cannot be checked, so those are never touched.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from pathlib import Path

from shared.shm import segment_path

log = logging.getLogger(__name__)
_NAME = re.compile(r"^kvpath-rx-(\d+)-(\d+)-[0-9a-f]+-[A-Za-z0-9]+$")
_SOCKET = re.compile(r"^kvpath-rx-\d+-\d+-[0-9a-f]+-ctl$")


@functools.cache
def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_prefix(uid: str) -> str:
    """Prefix of every segment name of one receiver (`uid`: hex, unique per receiver)."""
    return f"kvpath-rx-{_pid_namespace()}-{os.getpid()}-{uid}"


def control_socket_path(uid: str) -> Path:
    """Where a receiver listens for its shm senders' control connections (named like its segments)."""
    return segment_path(f"{segment_prefix(uid)}-ctl")


def is_control_socket_path(path: str) -> bool:
    """Whether `path` (from a registry entry) names a receiver's control socket: in the shm directory and
    named like one, so a bad or hostile entry cannot point a sender at another Unix socket of the host."""
    where = Path(path)
    return where.parent == segment_path("probe").parent and _SOCKET.match(where.name) is not None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments() -> int:
    """Unlink receiver segments whose owner process is gone (same pid namespace only); returns how many."""
    directory = segment_path("probe").parent
    namespace = str(_pid_namespace())
    removed = 0
    for path in directory.glob("kvpath-rx-*"):
        match = _NAME.match(path.name)
        if match is None or match.group(1) != namespace or _is_alive(int(match.group(2))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    if removed:
        log.info("kv receiver: removed %d shared-memory segments left by dead receivers", removed)
    return removed

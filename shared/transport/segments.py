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

from shared.shm import segment_path

log = logging.getLogger(__name__)
_NAME = re.compile(r"^kvpath-rx-(\d+)-(\d+)-[0-9a-f]+-[A-Za-z0-9]+$")


@functools.cache
def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_prefix(uid: str) -> str:
    """Prefix of every segment name of one receiver (`uid`: hex, unique per receiver)."""
    return f"kvpath-rx-{_pid_namespace()}-{os.getpid()}-{uid}"


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

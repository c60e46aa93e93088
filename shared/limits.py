"""Process limits a serving process raises for itself at start."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_files_limit() -> int:
    """The soft limit on open files raised to the hard one (as vLLM and nginx's `worker_rlimit_nofile` do):
    every client connection, KV data-plane socket and stored file is a descriptor, and a soft limit of 1,024
    (many distributions' default) reset connections past it (a router under a soft 256: 359 of 600
    concurrent streams reset). Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # a platform capping it below the hard limit
            log.warning("open files limit stays at %d (hard %s): %s", soft, hard, exc)
            return soft
        return target
    return soft

"""Bounds on native (non-Python) memory of processes that run the model.

Measured in `kvpath bench faults`' soak: an engine serving prompts of every length grew from 550 to 1,480 MiB
RSS in 90 s, none of it Python objects (tracemalloc stayed flat): glibc's per-thread malloc arenas (64 MiB
each, one per thread that touched tensors), its dynamic mmap threshold (which keeps freed activations of a
few MB in the heap instead of returning them), and oneDNN's per-shape primitive cache (1,024 entries by
default, one per distinct prompt length). Calling `bound()` first thing in the process caps the arenas,
fixes the mmap threshold so large buffers go back to the OS when freed, and caps the oneDNN cache.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc mallopt parameters (malloc.h)
M_ARENA_MAX = -8
ARENA_MAX = 2
MMAP_THRESHOLD_BYTES = 1 << 20
ONEDNN_CACHE_ENTRIES = "128"


def bound() -> bool:
    """Apply the bounds (before torch is imported); False where libc is not glibc (nothing to do)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_ARENA_MAX, ARENA_MAX)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.warning("mallopt refused the native memory bounds; RSS may grow with prompt shapes")
    return ok

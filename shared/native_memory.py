"""Bounds on native (non-Python) memory of processes that run the model.

Measured in `kvpath bench faults`' soak: an engine serving prompts of every length grew from 550 to 1,480 MiB
RSS in 90 s, none of it Python objects (tracemalloc stayed flat): glibc's per-thread malloc arenas (64 MiB
each, one per thread that touched tensors), its dynamic mmap threshold (which keeps freed activations of a
few MB in the heap instead of returning them), oneDNN's per-shape primitive cache (1,024 entries by
default, one per distinct prompt length) and, the largest, ideep's cache of packed-linear computations
(`LRU_CACHE_CAPACITY`, 1,024 by default): every distinct number of rows a packed linear sees (each prompt
length) kept one entry of some 100-300 KB, so an engine serving prompts of every length grew by ~90 MiB a
minute until 1,024 x 4 weight shapes were cached (found by bisection: one decoder layer fed prompts of 150-400
tokens grew malloc's in-use bytes from 97 to 358 MiB in 600 calls; with the packed linear off, or the cache at
128, it stayed flat). Calling `bound()` first thing in the process caps the arenas, fixes the mmap threshold
so large buffers go back to the OS when freed, and caps both caches (decode's few batch sizes stay cached).
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
IDEEP_CACHE_ENTRIES = "128"  # entries are per (weight shape, rows): 4 weight shapes x 32 row counts


def bound() -> bool:
    """Apply the bounds (before torch is imported); False where libc is not glibc (nothing to do)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
    os.environ.setdefault("LRU_CACHE_CAPACITY", IDEEP_CACHE_ENTRIES)
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_ARENA_MAX, ARENA_MAX)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.warning("mallopt refused the native memory bounds; RSS may grow with prompt shapes")
    return ok

"""A store without a configured capacity keeps what its file system has room for.

`capacity_bytes` 0 used to mean unlimited: once the disk filled, every write failed as storage full and the
cache stopped learning, its least recently used files kept forever. Now the file system is the limit: before
each write reserves room, the catalog's capacity becomes the bytes of its files already on disk plus the
free space beyond a reserve (`min_free_bytes`; by default 5% of the file system, at most 1 GiB), so new
blocks evict the least recently used ones (announced as BlockRemoved) as a configured capacity does. The
space is read each time: files other programs write or delete on the same disk count.
"""

from __future__ import annotations

import os
from pathlib import Path

RESERVE_FRACTION = 0.05
RESERVE_MAX_BYTES = 1 << 30


def reserve_bytes(total_bytes: int, min_free_bytes: int) -> int:
    """The free space kept on a file system of `total_bytes` (`min_free_bytes` < 0: the default)."""
    if min_free_bytes >= 0:
        return min_free_bytes
    return min(RESERVE_MAX_BYTES, int(total_bytes * RESERVE_FRACTION))


def disk_capacity(root: Path, on_disk_bytes: int, min_free_bytes: int) -> int:
    """The bytes the catalog may account for: its `on_disk_bytes` plus the file system's free space beyond
    the reserve; at least 1 (0 means unlimited to the catalog)."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    return max(1, on_disk_bytes + free - reserve_bytes(total, min_free_bytes))

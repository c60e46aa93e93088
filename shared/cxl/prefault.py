"""Map the pool's pages into this process ahead of its reads: `madvise(MADV_POPULATE_READ)` in a thread.

A process that maps the pool pays a page fault for every page it touches first (the kernel builds its page
tables then). With 4 KiB pages, as /dev/shm has, that is ~17 ms per 279 MB on this machine: as much as
the copy itself, paid by the first load of each block in each engine. DAX devices and hugetlbfs map 2 MiB
pages and barely pay it. Populating the mapping once in the background, in chunks, moves that cost off the
request path; the pool service allocated every page when it created the devices (`pool_memory._reserve`),
so this only maps them (a process's RSS then counts the pool's pages: shared memory, held once).

`MADV_POPULATE_READ` (Linux 5.14) only creates mappings: it does not change the memory, so it is safe while
other processes write. Where the kernel lacks it the thread stops at once and reads fault as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_READ = 22
CHUNK_BYTES = 64 << 20  # per madvise call: the thread can stop between two


def _madvise() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.madvise
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    func.restype = ctypes.c_int
    return func  # a ctypes foreign call releases the GIL while the kernel works


class Prefaulter:
    """Populates `regions` (page-aligned arrays over the mappings) in a daemon thread; `stop` before the
    mappings are closed."""

    def __init__(self, regions: Sequence[np.ndarray], *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._regions = [(r.ctypes.data, r.nbytes) for r in regions if r.nbytes]
        self._chunk = chunk_bytes
        self._stop = threading.Event()
        self.populated_bytes = 0
        self.seconds = 0.0
        self.error = ""
        self._thread = threading.Thread(target=self._run, name="pool-prefault", daemon=True)

    def start(self) -> Prefaulter:
        self._thread.start()
        return self

    def _run(self) -> None:
        madvise = _madvise()
        if madvise is None:
            self.error = "no madvise"
            return
        started = time.perf_counter()
        for base, size in self._regions:
            for offset in range(0, size, self._chunk):
                if self._stop.is_set():
                    return
                length = min(self._chunk, size - offset)
                if madvise(base + offset, length, MADV_POPULATE_READ) != 0:
                    code = ctypes.get_errno()
                    self.error = errno.errorcode.get(code, str(code))
                    log.info("pool prefault stopped (%s): first reads fault as they go", self.error)
                    return
                self.populated_bytes += length
        self.seconds = time.perf_counter() - started
        log.info("pool prefaulted: %.1f GiB in %.2f s", self.populated_bytes / 2**30, self.seconds)

    def wait(self, timeout_s: float) -> bool:
        """True once the thread ended (done, failed or stopped)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop between chunks and wait for the call in progress (one chunk: milliseconds)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

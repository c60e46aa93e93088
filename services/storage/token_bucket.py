"""Token bucket emulating a storage NIC: bytes/s with an optional burst, as a virtual clock.

`reserve(nbytes, now)` returns when those bytes will have crossed the link if they queue behind every
earlier reservation; the caller finishes its I/O no earlier than that. Over any window the bytes that
complete are at most rate x window + burst, which is what the bandwidth test checks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    rate_bytes_per_s: float  # 0: unlimited
    burst_bytes: float = 0.0
    _busy_until_s: float = 0.0

    @property
    def is_unlimited(self) -> bool:
        return self.rate_bytes_per_s <= 0

    def reserve(self, nbytes: int, now_s: float) -> float:
        """Reserve `nbytes`; return the time (same clock as `now_s`) at which they have been sent."""
        if self.is_unlimited:
            return now_s
        credit_s = self.burst_bytes / self.rate_bytes_per_s
        start_s = max(self._busy_until_s, now_s - credit_s)
        self._busy_until_s = start_s + nbytes / self.rate_bytes_per_s
        return self._busy_until_s

    def backlog_s(self, now_s: float) -> float:
        """Seconds of reserved transfer still ahead."""
        return max(0.0, self._busy_until_s - now_s)

"""Leases of node-buffer extents: who holds which bytes, until when.

A read's extent is leased to its request; the engine releases it explicitly, and a lease past its
deadline (the engine died or forgot) is reclaimed by the service. Pure bookkeeping, monotonic seconds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class Lease:
    lease_id: str
    request_id: str
    offset: int
    num_blocks: int
    block_bytes: int
    deadline_s: float


@dataclass(slots=True)
class LeaseTable:
    _by_id: dict[str, Lease] = field(default_factory=dict)
    _by_request: dict[str, set[str]] = field(default_factory=dict)
    _deadlines: list[tuple[float, str]] = field(default_factory=list)  # heap, may hold released ids

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def leased_bytes(self) -> int:
        return sum(lease.num_blocks * lease.block_bytes for lease in self._by_id.values())

    def add(self, lease: Lease) -> None:
        if lease.lease_id in self._by_id:
            raise KeyError(f"lease {lease.lease_id} exists")
        self._by_id[lease.lease_id] = lease
        self._by_request.setdefault(lease.request_id, set()).add(lease.lease_id)
        heapq.heappush(self._deadlines, (lease.deadline_s, lease.lease_id))

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def pop(self, lease_id: str) -> Lease | None:
        lease = self._by_id.pop(lease_id, None)
        if lease is not None:
            ids = self._by_request.get(lease.request_id)
            if ids is not None:
                ids.discard(lease_id)
                if not ids:
                    del self._by_request[lease.request_id]
        return lease

    def pop_request(self, request_id: str) -> list[Lease]:
        return [lease for lid in list(self._by_request.get(request_id, ())) if (lease := self.pop(lid))]

    def pop_expired(self, now_s: float) -> list[Lease]:
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._by_id.get(lease_id)
            if lease is not None and lease.deadline_s <= now_s:
                out.append(lease)
                self.pop(lease_id)
        return out

    def next_deadline_s(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._by_id:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

"""Configuration of one CXL-RPC endpoint: its geometry (the server's; clients read it from the segment)
and the timing of both sides."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import doc
from shared.cxl.layout import Layout


@dataclass(slots=True)
class RpcConfig:
    """Every field has a default; `validate()` raises ValueError naming the offending values."""

    num_clients: int = doc(16, "client entries in the segment (processes attached at once)")
    queue_depth: int = doc(4, "request/response slot pairs per client (calls in flight per client)")
    payload_bytes: int = doc(16384, "bulk bytes per slot, a multiple of 64 (a LOOKUP of 1000 hashes: 8 KB)")
    server_spin_s: float = doc(50e-6, "server: poll this long after its last request before it sleeps")
    idle_wake_s: float = doc(0.1, "server: longest sleep; it wakes this often for heartbeat and liveness")
    housekeeping_s: float = doc(0.02, "server: heartbeat and client checks this often while busy")
    client_spin_s: float = doc(40e-6, "client: poll for a reply this long before sleeping on a futex")
    async_spin_s: float = doc(20e-6, "acall: poll this long on the event loop before waiting in a thread")
    liveness_check_s: float = doc(0.01, "client: while waiting, check that the server lives this often")
    server_stale_s: float = doc(1.0, "client: a server heartbeat older than this means a hung server")
    attach_timeout_s: float = doc(2.0, "client: deadline for the server to adopt a new client")

    @property
    def layout(self) -> Layout:
        return Layout(self.num_clients, self.queue_depth, self.payload_bytes)

    def validate(self) -> None:
        self.layout  # noqa: B018  (Layout checks the geometry)
        for name in ("server_spin_s", "client_spin_s", "async_spin_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        positive = ("idle_wake_s", "housekeeping_s", "liveness_check_s", "server_stale_s", "attach_timeout_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.server_stale_s <= self.idle_wake_s:
            raise ValueError(
                f"server_stale_s ({self.server_stale_s}) must exceed idle_wake_s ({self.idle_wake_s}): "
                "an idle server refreshes its heartbeat only that often"
            )

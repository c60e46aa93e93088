"""KV pool metrics (Prometheus names and base units; documented in docs/metrics.md)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

OPS = Counter(
    "kvpath_cxlpool_ops_total", "Pool operations by op and transport (shm, nats)", ["op", "transport"]
)
BAD_REQUESTS = Counter("kvpath_cxlpool_bad_requests_total", "Pool requests answered with an error status")
EVENTS_FAILED = Counter(
    "kvpath_cxlpool_events_failed_total", "KV events (cxl tier) that could not be published"
)
CLIENTS_GONE = Counter("kvpath_cxlpool_clients_gone_total", "CXL-RPC clients found dead (leases released)")
SLOTS = Gauge(
    "kvpath_cxlpool_slots", "Pool slots by state (free, allocated, committed, quarantined)", ["state"]
)
PINNED = Gauge("kvpath_cxlpool_pinned_blocks", "Committed blocks under a read lease")
EVICTED = Gauge("kvpath_cxlpool_evicted_blocks", "Blocks evicted since the pool started")


def bind_stats(stats: Any) -> None:
    """Make the state gauges read `stats()` (a TableStats-like object) at scrape time."""
    SLOTS.labels("free").set_function(lambda: stats().num_free)
    SLOTS.labels("allocated").set_function(lambda: stats().num_allocated)
    SLOTS.labels("committed").set_function(lambda: stats().num_committed)
    SLOTS.labels("quarantined").set_function(lambda: stats().num_quarantined)
    PINNED.set_function(lambda: stats().num_pinned)
    EVICTED.set_function(lambda: stats().evicted)

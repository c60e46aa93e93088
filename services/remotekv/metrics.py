"""Prometheus metrics of the remote KV store (module level: one set per process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "kvpath_remotekv_requests_total",
    "Metadata requests by op (info, put, commit, get, exist) and outcome (ok, or the error code)",
    ["op", "outcome"],
)
CHUNKS = Counter(
    "kvpath_remotekv_chunks_total",
    "Super blocks named by requests, by op and outcome (put: ok, exists, full; commit: committed, "
    "released; get: hit, miss)",
    ["op", "outcome"],
)
READ_BYTES = Counter("kvpath_remotekv_read_bytes_total", "Super-block bytes written out to engines (GETs)")
COMMITTED_BYTES = Counter(
    "kvpath_remotekv_committed_bytes_total", "Super-block bytes engines wrote in and committed (PUTs)"
)
EVICTIONS = Counter("kvpath_remotekv_evicted_chunks_total", "Committed super blocks evicted (LRU) for room")
EXPIRED = Counter(
    "kvpath_remotekv_expired_reservations_total", "PUT reservations given back uncommitted at their deadline"
)
REQUEST_SECONDS = Histogram(
    "kvpath_remotekv_request_seconds",
    "Time to serve one request by op (a GET includes writing its super blocks to the engine)",
    ["op"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
# gauges read the slot table at scrape time (bound by the service: `bind_table`)
USED_BYTES = Gauge("kvpath_remotekv_used_bytes", "Bytes of slots in use (reserved or committed)")
CAPACITY_BYTES = Gauge("kvpath_remotekv_capacity_bytes", "Bytes of DRAM the store may fill")
CHUNKS_HELD = Gauge("kvpath_remotekv_held_chunks", "Committed super blocks held")
GETS_IN_FLIGHT = Gauge("kvpath_remotekv_gets_in_flight", "GETs writing super blocks out now")


def bind_table(table: Any, gets_in_flight: Any) -> None:
    """Make the gauges read `table.used_bytes`, `.capacity_bytes`, `.num_committed` and the GET count."""
    USED_BYTES.set_function(lambda: table.used_bytes)
    CAPACITY_BYTES.set_function(lambda: table.capacity_bytes)
    CHUNKS_HELD.set_function(lambda: table.num_committed)
    GETS_IN_FLIGHT.set_function(gets_in_flight)

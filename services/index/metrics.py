"""Prometheus metrics of the index service (names and units documented in docs/metrics.md)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

# state gauges read the live index at scrape time (bound by the service: `bind_index`)
BLOCKS = Gauge("kvpath_index_blocks", "Block hashes in the index (any location)")
TABLE_BYTES = Gauge("kvpath_index_table_bytes", "Bytes of the index's hash table")
LOCATIONS = Gauge("kvpath_index_locations", "Live locations (tiers x engines/nodes) the index tracks")
APPLIED_STREAM_SEQ = Gauge(
    "kvpath_index_applied_stream_seq", "KV-events stream sequence applied last (compare with the stream)"
)
EVENTS_APPLIED = Counter("kvpath_index_events_applied_total", "KV events applied to the index")
EVENTS_IGNORED = Counter(
    "kvpath_index_events_ignored_total", "KV events ignored as duplicates or replays (idempotency)"
)
EVENTS_MALFORMED = Counter("kvpath_index_events_malformed_total", "KV events that could not be decoded")
MATCH_SECONDS = Histogram(
    "kvpath_index_match_seconds",
    "Time to answer one prefix match (validation and lookup)",
    buckets=(0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)
MATCH_BLOCKS = Counter(
    "kvpath_index_match_blocks_total",
    "Block hashes asked about in matches, by outcome (hit, miss)",
    ["outcome"],
)


def bind_index(service: Any) -> None:
    """Make the state gauges read `service.index` (which a snapshot restore may replace)."""
    BLOCKS.set_function(lambda: len(service.index))
    TABLE_BYTES.set_function(lambda: service.index.nbytes)
    LOCATIONS.set_function(lambda: len(service.index.live_locations()))
    APPLIED_STREAM_SEQ.set_function(lambda: service.index.applied_stream_seq)

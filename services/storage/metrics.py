"""Prometheus metrics of the storage service (module level: one set per process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

READS = Counter(
    "kvpath_storage_reads_total", "Read requests by outcome (hit, partial, timeout, cancelled)", ["outcome"]
)
READ_BLOCKS = Counter("kvpath_storage_read_blocks_total", "Blocks read into the node buffer", ["outcome"])
READ_BYTES = Counter("kvpath_storage_read_bytes_total", "Payload bytes read from block files")
BAD_BLOCKS = Counter(
    "kvpath_storage_bad_blocks_total",
    "Blocks found missing, corrupt or foreign on read (then removed)",
    ["reason"],
)
WRITE_BLOCKS = Counter(
    "kvpath_storage_write_blocks_total", "Blocks persisted, by outcome (written, existing)", ["outcome"]
)
WRITE_BYTES = Counter("kvpath_storage_write_bytes_total", "Bytes written to block files")
WRITE_ERRORS = Counter(
    "kvpath_storage_write_errors_total", "Write requests that failed, by reason", ["reason"]
)
EVICTIONS = Counter("kvpath_storage_evicted_blocks_total", "Block files removed by LRU eviction")
EVENT_ERRORS = Counter("kvpath_storage_event_errors_total", "KV events that could not be published")
LEASES_EXPIRED = Counter("kvpath_storage_leases_expired_total", "Read leases reclaimed after their deadline")
READ_QUEUE_REQUESTS = Gauge("kvpath_storage_read_requests_pending", "Read requests queued or running")
# queue gauges read the live queues at scrape time (bound by the service: `bind_queues`)
READ_QUEUE_TOKENS = Gauge("kvpath_storage_read_queue_tokens", "Tokens of the blocks queued or being read")
READ_QUEUE_BYTES = Gauge("kvpath_storage_read_queue_bytes", "Bytes of the blocks queued or being read")
WRITE_QUEUE_REQUESTS = Gauge("kvpath_storage_write_requests_pending", "Write requests queued or running")
READ_SECONDS = Histogram(
    "kvpath_storage_read_seconds",
    "Time to serve one read request (queue, bandwidth budget and I/O)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
BUFFER_USED_BYTES = Gauge(
    "kvpath_storage_buffer_used_bytes", "Node buffer bytes allocated (reads and leases)"
)
BUFFER_LEASED_BYTES = Gauge("kvpath_storage_buffer_leased_bytes", "Node buffer bytes leased to engines")
STORE_USED_BYTES = Gauge("kvpath_storage_store_used_bytes", "Bytes of block files this node accounts for")
STORE_CAPACITY_BYTES = Gauge(
    "kvpath_storage_store_capacity_bytes",
    "Bytes of block files this node may keep: its capacity, or else its files plus the disk's free room",
)


def bind_queues(reader: Any, writer: Any) -> None:
    """Make the queue gauges read `reader.queue_tokens`, `.queue_bytes` and `writer.num_pending`."""
    READ_QUEUE_TOKENS.set_function(lambda: reader.queue_tokens)
    READ_QUEUE_BYTES.set_function(lambda: reader.queue_bytes)
    WRITE_QUEUE_REQUESTS.set_function(lambda: writer.num_pending)

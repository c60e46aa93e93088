"""Engine metrics (Prometheus names and base units; documented in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

PREFILL_STEP = Histogram(
    "kvpath_engine_prefill_step_seconds", "Wall time of one prefill forward", buckets=_STEP_BUCKETS
)
DECODE_STEP = Histogram(
    "kvpath_engine_decode_step_seconds", "Wall time of one decode step", buckets=_STEP_BUCKETS
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_SIZE = Histogram("kvpath_engine_decode_batch_size", "Sequences per decode step", buckets=_BATCH_BUCKETS)
PREFILL_BATCH_SIZE = Histogram(
    "kvpath_engine_prefill_batch_size", "Sequences computed per prefill step", buckets=_BATCH_BUCKETS
)
PREFILL_TOKENS = Counter("kvpath_engine_prefill_tokens_total", "Prompt tokens computed (not loaded)")
REQUESTS = Counter("kvpath_engine_requests_finished_total", "Finished requests by finish reason", ["reason"])
ROUTER_GONE_ABORTS = Counter(
    "kvpath_engine_router_gone_aborts_total", "Requests aborted as their router left the registry for good"
)
KV_BLOCKS_USED = Gauge("kvpath_engine_kv_blocks_used", "Paged KV cache blocks in use")
KV_BLOCKS_TOTAL = Gauge("kvpath_engine_kv_blocks_total", "Paged KV cache blocks in all")
RUNNING = Gauge("kvpath_engine_requests_running", "Sequences holding KV blocks")
WAITING = Gauge("kvpath_engine_requests_waiting", "Sequences queued or fetching their stored prefix")
PREEMPTIONS = Counter(
    "kvpath_engine_preemptions_total",
    "Sequences whose cache blocks were taken back (cache full): running, or queued holding blocks",
    ["of"],
)
KV_LOADED_BLOCKS = Counter(
    "kvpath_engine_kv_loaded_blocks_total", "Stored prefix blocks loaded instead of computed"
)
KV_LOAD_MISSES = Counter(
    "kvpath_engine_kv_load_misses_total",
    "Planned prefix blocks not loaded, by reason (missing, corrupt, storage down, timeout)",
    ["reason"],
)
KV_PERSISTED_BLOCKS = Counter("kvpath_engine_kv_persisted_blocks_total", "Full blocks written to the store")
KV_PERSIST_FAILURES = Counter(
    "kvpath_engine_kv_persist_failures_total",
    "Full blocks not persisted, by reason (storage full or down, staging full, timeout)",
    ["reason"],
)
PREFILL_LAYERS = Histogram(
    "kvpath_engine_prefill_layer_seconds",
    "Average wall time per layer of one layerwise prefill batch (compute + KV I/O)",
    buckets=_STEP_BUCKETS,
)
STAGING_WAITS = Counter(
    "kvpath_engine_staging_waits_total",
    "Prefill requests that waited in line for room in the staging buffer of KV sent to decode engines",
)
TRANSFER_BYTES = Counter("kvpath_engine_kv_transfer_bytes_total", "KV bytes sent to other engines", ["path"])
PREFILL_PREDICTED = Histogram(
    "kvpath_engine_prefill_predicted_attention_seconds",
    "Predicted attention-layer time of each prefill batch (compute quota)",
    buckets=_STEP_BUCKETS,
)
POOL_BLOCKS = Counter(
    "kvpath_engine_kv_pool_blocks_total",
    "KV pool tier blocks by outcome: hit, miss, corrupt, error (reads), written, write_error",
    ["outcome"],
)
POOL_WRITE_SECONDS = Histogram(
    "kvpath_engine_kv_pool_write_seconds",
    "Time to allocate pool slots and copy a step's finished blocks into them",
    buckets=_STEP_BUCKETS,
)
REMOTE_CHUNKS = Counter(
    "kvpath_engine_kv_remote_chunks_total",
    "Remote tier super blocks by outcome: local_hit, remote_hit, miss, cache_full (reads); written, "
    "exists, full, write_error, write_skipped (writes)",
    ["outcome"],
)
REMOTE_ERRORS = Counter(
    "kvpath_engine_kv_remote_errors_total",
    "Remote tier operations that failed (a miss or a skipped write), by op and error code",
    ["op", "code"],
)
REMOTE_BYTES = Counter(
    "kvpath_engine_kv_remote_bytes_total",
    "KV bytes moved by the remote tier: in (GETs), out (PUTs)",
    ["direction"],
)
REMOTE_OP_SECONDS = Histogram(
    "kvpath_engine_kv_remote_op_seconds",
    "Remote tier time per op: get (a GET's super blocks landing locally), store (PUT, write, COMMIT)",
    ["op"],
    buckets=_STEP_BUCKETS,
)
REMOTE_CACHE_USED_BYTES = Gauge(
    "kvpath_engine_kv_remote_cache_used_bytes", "Bytes of the remote tier's local super-block cache in use"
)
REMOTE_CACHE_EVICTIONS = Counter(
    "kvpath_engine_kv_remote_cache_evicted_chunks_total", "Super blocks evicted from the local cache (LRU)"
)
SESSION_RESIDENT_BLOCKS = Gauge(
    "kvpath_engine_session_resident_blocks", "Cache blocks held by idle sessions between turns (AMPD)"
)
SESSION_EVICTIONS = Counter(
    "kvpath_engine_session_evictions_total", "Idle sessions whose resident KV was evicted for memory"
)
SESSION_EVENT_FAILURES = Counter(
    "kvpath_engine_session_event_failures_total", "hbm: location events (BlockStored/Removed) not published"
)
SESSION_PREFIX_SOURCE = Counter(
    "kvpath_engine_session_prefix_source_total",
    "Turns on a session engine by where their prefix came from: resident, pool, storage, pe (remote), none",
    ["source"],
)

# move the query (services/engine/route*.py, holder*.py): holder sessions and batches, requester routes
HOLDER_SESSIONS = Counter(
    "kvpath_engine_holder_sessions_total", "Route sessions asked of this holder, by outcome", ["outcome"]
)
HELD_PINS = Counter(
    "kvpath_engine_held_pins_total",
    "Requests naming a chunk (`kv_chunk`), by outcome: new (pinned now), named (an existing chunk took the "
    "name), failed (no room among unnamed chunks, or the prompt has no full block)",
    ["outcome"],
)
HOLDER_BATCH = Histogram(
    "kvpath_engine_holder_batch_size",
    "Route queries answered by one partial-attention call",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
HOLDER_ROWS = Counter(
    "kvpath_engine_holder_query_tokens_total", "Query tokens a holder attended for requesters"
)
HOLDER_REFUSED = Counter(
    "kvpath_engine_holder_refused_total", "Route queries refused (malformed, NaN, overloaded)"
)
ROUTED = Counter(
    "kvpath_engine_route_requests_total", "Requests with a held prefix, by what served it", ["primitive"]
)
FALLBACKS = Counter(
    "kvpath_engine_route_fallbacks_total", "Routed requests that fell back, by reason", ["reason"]
)
EXCHANGE = Histogram(
    "kvpath_engine_route_exchange_seconds",
    "One layer's route round trip seen by the requester",
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
EXCHANGE_SIZE = Histogram(
    "kvpath_engine_route_exchange_size",
    "Routed requests whose queries one route round trip carried (a forward's requests per holder)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)

"""Router metrics (Prometheus names and base units; documented in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

TTFT = Histogram(
    "kvpath_router_time_to_first_token_seconds",
    "Time from request arrival to first token",
    buckets=_LATENCY_BUCKETS,
)
ITL = Histogram(
    "kvpath_router_inter_token_latency_seconds",
    "Time between streamed tokens of a request",
    buckets=_LATENCY_BUCKETS,
)
E2E = Histogram(
    "kvpath_router_e2e_request_latency_seconds",
    "Time from request arrival to its last token",
    buckets=_LATENCY_BUCKETS,
)
REQUESTS = Counter(
    "kvpath_router_requests_total", "Finished requests by endpoint and outcome", ["endpoint", "outcome"]
)
RUNNING = Gauge("kvpath_router_requests_running", "Requests dispatched to an engine and not finished")
QUEUED = Gauge("kvpath_router_requests_queued", "Requests accepted and waiting for an engine")
PROMPT_TOKENS = Counter("kvpath_router_prompt_tokens_total", "Prompt tokens of finished requests")
CACHED_TOKENS = Counter("kvpath_router_cached_tokens_total", "Prompt tokens served from stored KV")
GENERATION_TOKENS = Counter("kvpath_router_generation_tokens_total", "Generated tokens streamed to clients")
INDEX_LOOKUPS = Counter(
    "kvpath_router_index_lookups_total", "Index lookups by outcome (hit, miss, error)", ["outcome"]
)
ENGINE_FAILURES = Counter(
    "kvpath_router_engine_failures_total",
    "Requests failed because their engine died, went silent or lost tokens",
    ["reason"],
)
TOKENS_RESENT = Counter(
    "kvpath_router_tokens_resent_total",
    "Token deltas an engine sent again: the router saw a gap or a silence in a stream (NATS lost a batch)",
)
TASKS_RESENT = Counter(
    "kvpath_router_tasks_resent_total",
    "Tasks sent again to the same engine: their ack was lost (timeout, NATS disconnect), the engine lives",
)
STREAMS_STALLED = Counter(
    "kvpath_router_streams_stalled_total",
    "Streamed responses cut because their client took no bytes for stream_write_timeout_s (stopped reading)",
)
ORPHANS_ABORTED = Counter(
    "kvpath_router_orphans_aborted_total",
    "Aborts of requests engines ran for this router that it did not know (a restarted router's old ones)",
)
REDISPATCHED = Counter(
    "kvpath_router_requests_redispatched_total",
    "Requests dispatched again because an engine serving them was lost before their first token",
    ["reason"],
)
DECODE_REFUSED = Counter(
    "kvpath_router_decode_refusals_total",
    "Hand-offs a decode engine refused for want of room (DE buffer or queue full): placed again (DualPath,"
    " always-remote) or prefilled on that decode engine itself (AMPD)",
)
ENGINES_SUSPECTED = Counter(
    "kvpath_router_engines_suspected_total",
    "Engines left out of decisions until their next load report, because another engine saw them go",
)
ENGINE_RETURN_WAITS = Counter(
    "kvpath_router_engine_return_waits_total",
    "Requests that found no engine and waited for one to come back (engine_return_wait_s)",
)
TTFT_STAGE = Histogram(
    "kvpath_router_ttft_stage_seconds",
    "Time to first token by stage: schedule, allocate (router), read, import, queue, prefill (engine)",
    ["stage"],
    buckets=_LATENCY_BUCKETS,
)
SESSION_ROUTES = Counter(
    "kvpath_router_session_routes_total",
    "Session prefills by where they ran (local, remote) and why (ttft_slack, itl_slack, cost, forced, ...)",
    ["route", "reason"],
)
SESSION_BINDS = Counter(
    "kvpath_router_session_binds_total",
    "Sessions bound to a decode engine: new, resident (unknown here, their KV on it), or rebound",
    ["reason"],
)
MOVEQUERY_CHOICES = Counter(
    "kvpath_router_movequery_choices_total",
    "Requests whose prompt starts with a chunk another engine holds, by primitive (route, fetch, local)",
    ["primitive"],
)
MOVEQUERY_BURST = Histogram(
    "kvpath_router_movequery_burst_size",
    "Move the query: other requests sharing the held chunk still undecided when one was priced (a burst)",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
)
PLANS = Counter(
    "kvpath_router_plan_total",
    "Requests by the plan `--policy auto` chose (where it prefilled / where its hit KV came from)",
    ["plan"],
)
PLAN_TTFT_ERROR = Histogram(
    "kvpath_router_plan_ttft_error_seconds",
    "`--policy auto`: |predicted - measured| TTFT (both from dispatch) of each request",
    buckets=_LATENCY_BUCKETS,
)

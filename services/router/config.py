"""Router configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.policy.ampd import SESSION_POLICIES, SLACK_ORDERS
from services.policy.auto import AUTO
from services.policy.colocated import COLOCATED_POLICIES
from services.policy.table_placement import POLICIES
from services.router.auto_pd import PD_PATHS
from services.router.disaggregated import PREFILL_ORDERS
from shared.config import BaseConfig, check, doc


@dataclass(slots=True)
class RouterConfig(BaseConfig):
    http_port: int = doc(8000, "port of the OpenAI-compatible HTTP API (0 picks a free one)")
    model: str = doc("tiny", "model name or HF checkpoint directory (tokenizer, chat template, context)")
    served_model_name: str = doc("", "model name clients send; defaults to the model's name")
    model_cache_dir: str = doc("", "where embedded models are materialized (default ~/.cache/kvpath/models)")
    policy: str = doc(
        "colocated",
        "scheduling policy: colocated | beluga | cache-aware | dualpath | basic | dualpath-rr | ampd | "
        "disagg-remote | session-colocated | auto (one cost model over every KV path the engines offer: "
        "colocated, or prefill and decode engines)",
    )
    max_tokens_limit: int = doc(8192, "largest max_tokens a request may ask for")
    request_deadline_s: float = doc(600.0, "every request fails with 504 after this long")
    task_ack_timeout_s: float = doc(5.0, "how long an engine may take to accept a task")
    engine_silence_timeout_s: float = doc(3.0, "an engine silent this long is dead: its streams fail")
    engine_return_wait_s: float = doc(
        15.0,
        "a request that finds no engine waits this long after one was last heard for it to come back "
        "(a restart), within its deadline (0: a 503 at once)",
    )
    stream_probe_s: float = doc(
        5.0, "a stream without a new token this long: its engines are asked to resend"
    )
    stream_write_timeout_s: float = doc(
        60.0, "a streamed response whose client takes no bytes this long is cut (its request aborted)"
    )
    max_redispatches: int = doc(
        2,
        "lost attempts a request survives (its engine died or restarted): sent again, or migrated mid-decode",
    )
    max_inflight_requests: int = doc(4096, "requests beyond this are refused with 429")
    retry_after_s: int = doc(1, "Retry-After seconds on 503 when no engine is available")
    use_kv_cache: bool = doc(True, "ask the metadata index for stored prefixes (KV reuse across turns)")
    index_timeout_s: float = doc(0.5, "deadline of an index lookup; on expiry the request recomputes")
    alpha_s: float = doc(3.0, "DualPath: a node read queue under this many seconds of reads is short")
    beta_s: float = doc(5.0, "DualPath: a PE with more than this many seconds of prefill work gets nothing")
    z_factor: float = doc(1.05, "DualPath: DE high-token threshold multiplier")
    force_read_side: str = doc(
        "", "experiments: read stored prefixes on this side (pe | de) when it can read"
    )
    prefill_order: str = doc(
        "fcfs",
        "dualpath | basic | dualpath-rr: the order the placement queue offers waiting requests in, fcfs | "
        "short-first (fewest tokens to compute first, none passed for more than short_first_ratio x its own; "
        "and past beta on a short-first PE whose shorter prefills take under beta_s)",
    )
    short_first_ratio: float = doc(
        1.0, "short-first order: shorter requests may pass a request for up to this x its own compute"
    )
    ttft_slo_ms: float = doc(2000.0, "TTFT SLO of a request that names none (`ttft_slo_ms` extension)")
    itl_slo_ms: float = doc(100.0, "ITL SLO of a request that names none (`itl_slo_ms` extension)")
    ampd_alpha: float = doc(0.9, "AMPD: a PE whose windowed TTFT is under alpha x TTFT SLO has slack")
    ampd_beta: float = doc(0.85, "AMPD: a DE whose windowed ITL is under beta x ITL SLO has slack")
    ampd_window_s: float = doc(10.0, "AMPD: window of the TTFT / ITL statistics")
    ampd_route_initial: bool = doc(True, "AMPD: route initial prefills by Algorithm 1 too (else remote)")
    ampd_slack_order: str = doc(
        "random", "AMPD: the PE with TTFT slack that takes a prefill: random | least-queue"
    )
    remote_pick: str = doc("rr", "disagg-remote: the PE of each prefill, rr (round robin) | least-queue")
    cost_profile: str = doc("", "AMPD, auto: cost profile file of `kvpath profile` (default: measured rates)")
    kv_link: str = doc("shm", "AMPD, auto: the cost profile's link between prefill and decode engines")
    auto_decode_engines: str = doc(
        "session",
        "auto on prefill/decode engines: what the decode engines are, session (--session-kv: local "
        "prefill, history kept in HBM) | dualpath (decode only: the prefix read on either node)",
    )
    move_query: str = doc(
        "", "prompts starting with a chunk another engine holds: auto | route | fetch | local ('' off)"
    )
    movequery_profile: str = doc("", "move_query: calibrated cost profile (default: an uncalibrated guess)")
    movequery_fabric: str = doc("shm", "move_query: the profile's fabric between engines (shm | tcp | rdma)")
    api_key_file: str = doc(
        "", "file of API keys, one per line: `<key>` or `<key> <tenant>` (none configured: the API is open)"
    )
    api_keys: list[str] = doc(  # noqa: RUF009
        [], "API keys `<key>` or `<key>:<tenant>` (development; prefer api_key_file: flags are visible)"
    )
    max_request_bytes: int = doc(32 << 20, "largest request body; larger ones get a JSON 413")
    request_read_timeout_s: float = doc(
        60.0, "a request body not received whole this long after its headers is a 408 (connection closed)"
    )

    def validate(self) -> None:
        BaseConfig.validate(self)
        policies = (*COLOCATED_POLICIES, *POLICIES, *SESSION_POLICIES, AUTO)
        check(self.policy in policies, "policy", self.policy, f"one of {', '.join(policies)}")
        check(self.max_tokens_limit >= 1, "max_tokens_limit", self.max_tokens_limit, "must be >= 1")
        timeouts = (
            "request_deadline_s",
            "stream_write_timeout_s",
            "stream_probe_s",
            "request_read_timeout_s",
        )
        for name in timeouts:
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for name in ("max_redispatches", "engine_return_wait_s"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        check(
            self.engine_silence_timeout_s > self.load_report_interval_s,
            "engine_silence_timeout_s",
            self.engine_silence_timeout_s,
            "must exceed load_report_interval_s",
        )
        check(
            self.force_read_side in ("", "pe", "de"),
            "force_read_side",
            self.force_read_side,
            "empty, pe or de",
        )
        self._validate_prefill_order()
        for name in ("alpha_s", "beta_s", "z_factor"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        check(self.max_inflight_requests >= 1, "max_inflight_requests", self.max_inflight_requests, ">= 1")
        for name in ("ttft_slo_ms", "itl_slo_ms", "ampd_alpha", "ampd_beta", "ampd_window_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        check(
            self.auto_decode_engines in PD_PATHS,
            "auto_decode_engines",
            self.auto_decode_engines,
            f"one of {', '.join(PD_PATHS)}",
        )
        check(self.remote_pick in ("rr", "least-queue"), "remote_pick", self.remote_pick, "rr or least-queue")
        check(
            self.ampd_slack_order in SLACK_ORDERS,
            "ampd_slack_order",
            self.ampd_slack_order,
            str(SLACK_ORDERS),
        )
        check(
            self.move_query in ("", "auto", "route", "fetch", "local"),
            "move_query",
            self.move_query,
            "auto, route, fetch, local or empty",
        )
        check(self.max_request_bytes >= 1024, "max_request_bytes", self.max_request_bytes, ">= 1024")

    def _validate_prefill_order(self) -> None:
        order = self.prefill_order
        check(order in PREFILL_ORDERS, "prefill_order", order, f"one of {', '.join(PREFILL_ORDERS)}")
        if order != "fcfs":  # the others dispatch at once: their engines order their own queues
            check(self.policy in POLICIES, "prefill_order", order, f"needs a policy of {', '.join(POLICIES)}")
        ratio = self.short_first_ratio
        check(0 <= ratio <= 100, "short_first_ratio", ratio, "between 0 and 100")

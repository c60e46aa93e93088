"""Router configuration."""

from __future__ import annotations

from dataclasses import dataclass

from services.policy.colocated import COLOCATED_POLICIES
from services.policy.placement import POLICIES
from shared.config import BaseConfig, check, doc


@dataclass(slots=True)
class RouterConfig(BaseConfig):
    http_port: int = doc(8000, "port of the OpenAI-compatible HTTP API (0 picks a free one)")
    model: str = doc("tiny", "model name or HF checkpoint directory (tokenizer, chat template, context)")
    served_model_name: str = doc("", "model name clients send; defaults to the model's name")
    model_cache_dir: str = doc("", "where embedded models are materialized (default ~/.cache/kvpath/models)")
    policy: str = doc(
        "colocated", "scheduling policy: colocated | beluga | cache-aware | dualpath | basic | dualpath-rr"
    )
    max_tokens_limit: int = doc(8192, "largest max_tokens a request may ask for")
    request_deadline_s: float = doc(600.0, "every request fails with 504 after this long")
    task_ack_timeout_s: float = doc(5.0, "how long an engine may take to accept a task")
    engine_silence_timeout_s: float = doc(3.0, "an engine silent this long is dead: its streams fail")
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
    api_key_file: str = doc(
        "", "file of API keys, one per line: `<key>` or `<key> <tenant>` (none configured: the API is open)"
    )
    api_keys: list[str] = doc(  # noqa: RUF009
        [], "API keys `<key>` or `<key>:<tenant>` (development; prefer api_key_file: flags are visible)"
    )
    max_request_bytes: int = doc(32 << 20, "largest request body; larger ones get a JSON 413")

    def validate(self) -> None:
        BaseConfig.validate(self)
        policies = (*COLOCATED_POLICIES, *POLICIES)
        check(self.policy in policies, "policy", self.policy, f"one of {', '.join(policies)}")
        check(self.max_tokens_limit >= 1, "max_tokens_limit", self.max_tokens_limit, "must be >= 1")
        check(self.request_deadline_s > 0, "request_deadline_s", self.request_deadline_s, "must be > 0")
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
        for name in ("alpha_s", "beta_s", "z_factor"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        check(self.max_inflight_requests >= 1, "max_inflight_requests", self.max_inflight_requests, ">= 1")
        check(self.max_request_bytes >= 1024, "max_request_bytes", self.max_request_bytes, ">= 1024")

"""`ReplayConfig`: every knob of `kvpath loadgen replay` (CLI flag, `KVPATH_<FIELD>` env, YAML `loadgen:`)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from shared.config import check, doc

MODES = ("offline", "online")
ENDPOINTS = ("completions", "chat")
PROMPT_FORMATS = ("tokens", "text")
TEXT_UNITS = ("word", "char")
HISTORIES = ("synthetic", "output")
ARRIVALS = ("auto", "poisson", "trace")
PROGRESS = ("auto", "bar", "plain", "off")
ON_ERROR = ("end-session", "continue")


@dataclass(slots=True)
class ReplayConfig:
    url: str = doc("", "server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    trace: str = doc("", "trace file to replay")
    format: str = doc("auto", "trace format: auto, kvpath, mooncake or messages")
    mode: str = doc("offline", "offline: every agent starts at t=0 (JCT); online: agents arrive over time")
    out: str = doc("loadgen-result.json", "result JSON path (partial results on Ctrl-C)")
    label: str = doc("", "name of this run in reports (default: the URL)")
    model: str = doc("", "model name to request (default: the first of GET /v1/models)")
    endpoint: str = doc("completions", "OpenAI endpoint: completions or chat")
    prompt_format: str = doc("tokens", "completions prompt: token ids (exact lengths) or text")
    text_unit: str = doc(
        "word", "synthetic text: word (~1 BPE token each) or char (1 token each, byte vocab)"
    )
    history: str = doc(
        "synthetic", "next turn's context holds placeholder tokens or the server's actual output"
    )
    vocab_size: int = doc(
        0,
        "synthetic token ids are drawn from [min_token_id, min_token_id+vocab_size); 0: the served model's "
        "vocabulary (its model card's vocab_size) less min_token_id, or 32000 when the server does not say",
    )
    min_token_id: int = doc(0, "lowest synthetic token id")
    max_context: int = doc(0, "end a trajectory (truncate a single request) to fit this many tokens; 0: off")
    length_scale: float = doc(1.0, "multiply every trace length (CPU runs)")
    time_scale: float = doc(1.0, "multiply trace arrival times (trace arrivals)")
    tool_scale: float = doc(1.0, "multiply tool latencies (0: none)")
    exact_lengths: bool = doc(
        True, "send ignore_eos and min_tokens so outputs have exactly max_tokens tokens"
    )
    extra_body: str = doc("", "JSON object merged into every request body")
    session_header: bool = doc(True, "send X-Session-Id per agent")
    temperature: float = doc(0.0, "sampling temperature (negative: not sent)")
    max_concurrency: int = doc(0, "most requests in flight at once; 0: unlimited")
    skip: int = doc(0, "skip this many sessions (agents, requests) at the start of the trace")
    limit: int = doc(0, "use at most this many sessions after --skip; 0: all")
    agents: int = doc(0, "sessions to run, cycling the slice with fresh content if larger; 0: the slice once")
    max_turns: int = doc(0, "send at most this many turns of each session; 0: all")
    arrivals: str = doc("auto", "online arrivals: poisson (--rate), trace (timestamps) or auto")
    rate: float = doc(0.0, "online: Poisson agent (session) arrivals per second")
    duration_s: float = doc(0.0, "online: stop new arrivals after this long; 0: when the sessions run out")
    seed: int = doc(0, "seed of Poisson arrivals")
    content_salt: int = doc(-1, "mixed into synthetic content keys; -1: random per run (cold cache)")
    request_timeout_s: float = doc(600.0, "deadline of one request")
    ttft_slo_s: float = doc(4.0, "SLO on time to first token (DualPath: 4 s)")
    tpot_slo_s: float = doc(0.05, "SLO on time per output token (DualPath: 50 ms)")
    stop_on_slo: bool = doc(False, "online: stop when the windowed mean TTFT exceeds --ttft-slo-s")
    stop_when_steady: bool = doc(True, "online: stop once TTFT is steady (window vs the window lag earlier)")
    steady_window_s: float = doc(150.0, "steady-state window (DualPath: 150 s)")
    steady_lag_s: float = doc(1800.0, "compare with the window this much earlier (DualPath: 30 min)")
    steady_tolerance: float = doc(0.05, "steady when mean TTFT moved less than this fraction")
    on_error: str = doc("end-session", "after a failed request: end-session or continue")
    default_output_tokens: int = doc(256, "generation length of a messages call that records none")
    progress: str = doc("auto", "progress display: auto, bar, plain or off")
    progress_interval_s: float = doc(2.0, "period of plain progress lines")
    plot_dir: str = doc("", "also write PNG plots into this directory")
    api_key: str = doc("", "bearer token for the server (Authorization header)")

    def validate(self) -> None:
        check(bool(self.url), "url", self.url, "required (http://host:port)")
        check(self.url.startswith(("http://", "https://")), "url", self.url, "must start with http(s)://")
        check(bool(self.trace), "trace", self.trace, "required")
        self._check_choices()
        self._check_numbers()
        check(
            not (self.mode == "online" and self.arrivals == "poisson" and self.rate <= 0),
            "rate",
            self.rate,
            "online Poisson arrivals need --rate > 0",
        )
        self.extra_body_dict()

    def _check_choices(self) -> None:
        for name, allowed in (
            ("mode", MODES),
            ("endpoint", ENDPOINTS),
            ("prompt_format", PROMPT_FORMATS),
            ("text_unit", TEXT_UNITS),
            ("history", HISTORIES),
            ("arrivals", ARRIVALS),
            ("progress", PROGRESS),
            ("on_error", ON_ERROR),
            ("format", ("auto", "kvpath", "mooncake", "messages")),
        ):
            check(getattr(self, name) in allowed, name, getattr(self, name), f"one of {', '.join(allowed)}")

    def _check_numbers(self) -> None:
        for name in ("length_scale", "time_scale", "request_timeout_s", "progress_interval_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for name in ("tool_scale", "rate", "duration_s", "ttft_slo_s", "tpot_slo_s"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in (
            "max_concurrency",
            "skip",
            "limit",
            "agents",
            "max_turns",
            "max_context",
            "min_token_id",
        ):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        check(self.vocab_size == 0 or self.vocab_size >= 2, "vocab_size", self.vocab_size, "0 or >= 2")
        check(
            self.default_output_tokens >= 1,
            "default_output_tokens",
            self.default_output_tokens,
            "must be >= 1",
        )
        check(self.steady_window_s > 0, "steady_window_s", self.steady_window_s, "must be > 0")
        check(self.steady_lag_s > 0, "steady_lag_s", self.steady_lag_s, "must be > 0")
        check(0 < self.steady_tolerance < 1, "steady_tolerance", self.steady_tolerance, "in (0, 1)")

    def extra_body_dict(self) -> dict[str, object]:
        if not self.extra_body:
            return {}
        try:
            value = orjson.loads(self.extra_body)
        except orjson.JSONDecodeError as exc:
            check(False, "extra_body", self.extra_body, f"not valid JSON: {exc}")
        check(isinstance(value, dict), "extra_body", self.extra_body, "must be a JSON object")
        return dict(value)

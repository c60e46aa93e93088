"""Core message schemas: errors, registry entries, load reports, sampling, token streams, aborts.

Tasks (router -> engine) and the records engines exchange live in `shared.protocol.tasks`; KV-specific
records (events, index, storage) in `shared.protocol.kv`; data-plane records in `shared.protocol.transfer`.
Adding a field with a default is compatible; removing or retyping one bumps the kind's VERSION.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from shared.errors import KvpathError
from shared.protocol.codec import U64_MAX, Message, message


@message
class ErrorReply(Message):
    """Reply of a request handler that failed; `code` is a stable `shared.errors` code."""

    KIND = "error"
    code: str
    message: str
    param: str | None = None

    @classmethod
    def from_error(cls, exc: KvpathError) -> ErrorReply:
        return cls(code=exc.code, message=exc.message, param=exc.param)


@message
class Ack(Message):
    KIND = "ack"
    ok: bool = True
    detail: str = ""


@message
class KvFormat(Message):
    """What makes two engines' KV interchangeable: blocks hashed with one fingerprint (model, KV dtype, block
    size: `gpu.model_spec.ModelSpec.fingerprint`), of `block_size` tokens and `bytes_per_token` over all
    layers. Engines announce theirs; the router hashes prompts with it and refuses engines that differ."""

    KIND = "kv_format"
    fingerprint: str
    block_size: int
    bytes_per_token: int


@message
class RouteCapability(Message):
    """An engine that speaks move-the-query's route protocol (`--move-query`): the served model's shape, which
    prices a route without the model (`services/policy/movequery.ModelShape`), and, on a holder of chunks, its
    queue now."""

    KIND = "route_capability"
    RANGES = {
        "num_layers": (1, None),
        "rows_per_token": (1, None),
        "query_bytes_per_row": (1, None),
        "partial_bytes_per_row": (1, None),
        "kv_bytes_per_token_layer": (1, None),
        "holder_queue_s": (0.0, None),
        "holder_compute_s": (0.0, None),
        "num_holder_sessions": (0, None),
        "num_held_blocks": (0, None),
        "hold_budget_blocks": (0, None),
        "route_step_s": (0.0, 3600.0),
    }
    num_layers: int
    rows_per_token: int  # query rows per token (its query heads)
    query_bytes_per_row: int
    partial_bytes_per_row: int
    kv_bytes_per_token_layer: int
    holder_queue_s: float = 0.0  # how long the holder's queue holds an exchange now (0: not a holder)
    holder_compute_s: float = 0.0  # its last attention call per exchange
    num_holder_sessions: int = 0
    num_held_blocks: int = 0
    hold_budget_blocks: int = 0  # blocks it may hold (0: not a holder: keeps no chunks, takes no names)
    # requesters: the route exchanges of one decoding step of a routed request, measured (a moving average
    # of the recent ones; 0: none lately), which prices a route under this host's real load
    route_step_s: float = 0.0


@message
class ServiceInfo(Message):
    """Registry value of one live service, refreshed by its heartbeat."""

    KIND = "service_info"
    service_id: str
    service_kind: str  # router | engine | storage | index | cxlpool
    role: str = ""  # engines: colocated | prefill | decode
    node: int = 0
    status: str = "starting"  # starting | ready | draining
    http_url: str = ""
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    model: str = ""
    endpoints: dict[str, str] = field(default_factory=dict)  # data-plane endpoints by backend
    kv_format: KvFormat | None = None  # engines: the KV format they announce (also in their load reports)
    extra: dict[str, Any] = field(default_factory=dict)


# LoadReport.rates of engines: prompt tokens (loaded + computed) per second of prefill steps, the unit of
# DualPath's beta; and computed tokens per second of the prefill steps that loaded nothing, what a cost model
# built from measured rates prices new tokens at (at high hit rates the first is many times the second)
PROMPT_RATE = "prefill_tokens_per_s"
COMPUTE_RATE = "prefill_compute_tokens_per_s"


@message
class LoadReport(Message):
    """Periodic load of a service. Engines fill the scheduling fields, storage the read-queue ones."""

    KIND = "load_report"
    RANGES = {
        "waiting_kv_tokens": (0, None),
        "max_num_batched_tokens": (0, None),
        "kv_release_s": (0.0, None),
        "kv_release_tokens": (0, None),
        "decode_step_s": (0.0, 3600.0),
        "prefill_left_tokens": (0, None),
        "num_prefills": (0, None),
    }
    MAX_RELEASES = 64
    MAX_PREFILLS = 64
    PREFILL_ORDERS = ("", "fcfs", "slo", "short-first")
    service_id: str
    role: str
    node: int
    seq: int
    sent_at: float
    num_running: int = 0
    num_waiting: int = 0
    unfinished_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    read_queue_tokens: int = 0
    read_queue_bytes: int = 0
    is_draining: bool = False
    rates: dict[str, float] = field(default_factory=dict)  # measured rates: PROMPT_RATE, COMPUTE_RATE, ...
    waiting_kv_tokens: int = 0  # engines: KV tokens the requests queued on it will need
    max_num_batched_tokens: int = 0  # engines: prefill tokens per step (chunked beyond it); 0: not said
    route: RouteCapability | None = None  # engines speaking move-the-query's route protocol
    # engines: what they compute on; engines reporting the same id share it (a host's CPU cores, one GPU)
    compute_id: str = ""
    kv_format: KvFormat | None = None  # engines: the KV their cache holds
    # when this process of the service started (unix s): a new value under the same id is a restart, and
    # whatever the old process was serving is lost
    incarnation_unix_s: float = 0.0
    # engines: when their running requests give KV back, soonest first: after kv_release_s[i] seconds (from
    # sent_at; the answers' upper bounds) kv_release_tokens[i] more tokens (services/engine/load_state.py)
    kv_release_s: list[float] = field(default_factory=list)
    kv_release_tokens: list[int] = field(default_factory=list)
    decode_step_s: float = 0.0  # engines: the period of their decoding step, measured (0: not timed yet)
    # engines: their prefill queue's order and, when it is short-first, the tokens left to compute of their
    # unfinished prefills, fewest first (at most MAX_PREFILLS of `num_prefills`): the work each new prefill
    # would wait for there (`services/policy/short_first.work_ahead`)
    prefill_order: str = ""
    prefill_left_tokens: list[int] = field(default_factory=list)
    num_prefills: int = 0

    def check(self) -> None:
        if len(self.kv_release_s) != len(self.kv_release_tokens):
            raise ValueError("kv_release_s and kv_release_tokens differ in length")
        if len(self.kv_release_s) > self.MAX_RELEASES:
            raise ValueError(f"kv_release_s has more than {self.MAX_RELEASES} entries")
        if self.kv_release_s != sorted(self.kv_release_s):
            raise ValueError("kv_release_s is not in ascending order")
        if self.prefill_order not in self.PREFILL_ORDERS:
            raise ValueError(f"prefill_order {self.prefill_order!r} is not one of {self.PREFILL_ORDERS}")
        left = self.prefill_left_tokens
        if len(left) > min(self.MAX_PREFILLS, self.num_prefills) or left != sorted(left):
            raise ValueError("prefill_left_tokens: at most MAX_PREFILLS of num_prefills, in ascending order")


@message
class SamplingParams(Message):
    KIND = "sampling_params"
    RANGES = {
        "max_tokens": (1, None),
        "temperature": (0.0, 2.0),
        "top_p": (0.0, 1.0),  # 0: only the most likely token (OpenAI's range)
        "seed": (-(1 << 63), U64_MAX),
        "min_tokens": (0, None),
        "stop_token_ids": (0, None),
        "top_k": (0, None),
        "min_p": (0.0, 1.0),
        "repetition_penalty": (0.0, 10.0),  # and > 0 (check)
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
        "logit_bias_ids": (0, None),
        "logit_bias_values": (-100.0, 100.0),
        "logprobs": (-1, 20),
        "n": (1, 64),
    }
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias_ids: list[int] = field(default_factory=list)  # with logit_bias_values: token id -> bias
    logit_bias_values: list[float] = field(default_factory=list)
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and the k most likely
    grammar: str = ""  # llguidance grammar (gpu.grammar) the output must match; "": unconstrained
    n: int = 1  # choices sampled from one prefill of the prompt (the engine forks them: `choice`)

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: one choice, seeded `seed + index` (None stays unseeded), so
        the choices are distinct and each is reproducible alone."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def check(self) -> None:
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if len(self.logit_bias_ids) != len(self.logit_bias_values):
            raise ValueError("logit_bias_ids and logit_bias_values differ in length")


@message
class TokenDelta(Message):
    """New tokens of one request in one engine step. `seq` counts deltas of the request from 0."""

    KIND = "token_delta"
    OMIT_DEFAULTS = True
    request_id: str
    seq: int
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error_code: str = ""
    error_message: str = ""
    error_engine: str = ""  # the engine whose loss failed the request, when another engine saw it go
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, sent with the first delta
    handoff: bool = False  # the sending engine is done; later deltas come from another engine (PE -> DE)
    # with SamplingParams.logprobs >= 0: per token [logprob, [top ids], [top logprobs]]
    logprobs: list[Any] = field(default_factory=list)


@message
class TokenBatch(Message):
    """Engine -> router (`tokens.<router>`): every delta for that router from one engine step."""

    KIND = "token_batch"
    engine_id: str
    step: int
    deltas: list[TokenDelta]


@message
class TokenResend(Message):
    """Router -> engine (`resend.<engine>`, request/reply): the deltas of a request from `from_seq` on, as
    the engine sent them (a `TokenBatch` reply, empty when it keeps none): core NATS may lose a token batch
    (a server restart), and the router asks again when a stream has a gap or falls silent."""

    KIND = "token_resend"
    RANGES = {"from_seq": (0, None)}
    request_id: str
    from_seq: int = 0


@message
class Abort(Message):
    """Cancel a request everywhere (client gone, deadline passed, stop string seen)."""

    KIND = "abort"
    request_id: str
    reason: str = ""

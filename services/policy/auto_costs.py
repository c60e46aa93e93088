"""The terms of the `auto` policy's estimator, in seconds (pure; `services/policy/auto.py` adds them up).

One estimator prices every KV path of a request from two inputs only: the calibrated profiles (`kvpath
profile`'s T_pre / T_dec / T_kv, `services/policy/ampd_costs.py`; the move-the-query constants,
`movequery_profile.py`) and the live load snapshot. The terms:

  queueing   an engine's queued prefill tokens priced by its T_pre; a storage NIC's or the pool's pending
             reads ahead of this one; the data-plane link's busy time
  transfer   KV of `tokens` over a link (storage, pool, the engines' transport): T_kv
  compute    the prefill of `miss` new tokens over `hit` cached ones, in chunks of the engine's token budget
             (`max_num_batched_tokens`) as its scheduler runs it (`services/engine/scheduler.py`): every
             step prefills one chunk, T_pre(hit + done, chunk), and steps every running decode once, T_dec
  harm       what a plan costs the decodes already running: each of the prefill's steps is longer by its
             chunk's T_pre for every running decode, and one more sequence slows every later step

Harm is a sum of seconds over running decodes; `AutoProfiles.itl_weight` converts it into seconds of this
request's TTFT (a stall spread over many streams is worth less than the same wait on one request's first
token). Nothing here reads a clock, a file or the bus.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.policy.ampd_costs import STORAGE, CostModel, Piecewise
from services.policy.movequery import CostProfile, route_exchange_s
from shared.errors import ConfigError

# the engine's prefill token budget per step when its load report does not say (services/engine/config.py
# EngineConfig.max_num_batched_tokens; a test holds the two equal)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
POOL = "pool"  # the link of a read from the shared (CXL-style) pool
DEFAULT_DATA_LINK = "shm"  # the engines' data-plane transport, as `kvpath profile` names it


@dataclass(frozen=True, slots=True)
class AutoProfiles:
    """What the estimator is calibrated with. `costs`: T_pre, T_dec and T_kv per link; `route`: the
    move-the-query constants (None: routing to a holder is not priced, so never chosen); `itl_weight`:
    seconds of TTFT one second of delay summed over running decodes is worth (1: a second's stall of n running
    requests delays n completions by a second each, as much as this request's wait); `overhead_s`: what every
    request pays outside the model before its first token (dispatch, bus, delivery) and `time_scale` how much
    slower than profiled the machine runs now, both learned online by the router from its measured TTFTs
    (`auto_calibration.py`): a plan's TTFT is overhead_s + time_scale x the profile's, times `path_scale` of
    its path (a plan's label, e.g. `remote/hbm`) where the router measured that path off by a clear margin."""

    costs: CostModel
    data_link: str = DEFAULT_DATA_LINK
    storage_link: str = STORAGE
    pool_link: str = POOL
    route: CostProfile | None = None
    route_fabric: str = DEFAULT_DATA_LINK
    itl_weight: float = 1.0
    overhead_s: float = 0.0
    time_scale: float = 1.0
    path_scale: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.itl_weight >= 0 and self.overhead_s >= 0 and self.time_scale > 0):
            raise ConfigError(
                f"itl_weight={self.itl_weight}, overhead_s={self.overhead_s} (>= 0), "
                f"time_scale={self.time_scale} (> 0)"
            )

    def calibrated(self, raw_ttft_s: float, path: str = "") -> float:
        return (self.overhead_s + self.time_scale * raw_ttft_s) * self.path_scale.get(path, 1.0)


def prefill_queue_s(
    p: AutoProfiles,
    queued_tokens: int,
    kind: str,
    budget_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    decode_step_s: float = 0.0,
) -> float:
    """How long the prefills already queued on an engine of `kind` keep it busy, from their new tokens alone:
    they fill `budget_tokens` a step, so each step pays T_pre's fixed term once and the running decodes'
    `decode_step_s`, and every token its per-token term. Its attention term is left out: priced over the
    summed count it would grow with the square of the queue, not with its requests."""
    if queued_tokens <= 0:
        return 0.0
    num_steps = -(-queued_tokens // budget_tokens)
    chunk = min(queued_tokens, budget_tokens)
    a, b, _ = p.costs.prefill[kind].coef(chunk) if kind in p.costs.prefill else _first(p).coef(chunk)
    return max(0.0, num_steps * (a + decode_step_s) + b * queued_tokens)


def _first(p: AutoProfiles) -> Piecewise:
    return next(iter(p.costs.prefill.values()))


def read_s(p: AutoProfiles, link: str, queued_tokens: int, tokens: int) -> float:
    """A read of `tokens` tokens' KV over `link` (storage NIC, pool) behind `queued_tokens` already pending on
    it: the queue drains first, FIFO."""
    if tokens <= 0:
        return 0.0
    return p.costs.kv_s(queued_tokens + tokens, link)


def link_s(p: AutoProfiles, tokens: int, busy_s: float = 0.0) -> float:
    """`tokens` tokens' KV between two engines over the data plane, after the link's `busy_s`."""
    return 0.0 if tokens <= 0 else busy_s + p.costs.kv_s(tokens, p.data_link)


def compute_s(p: AutoProfiles, hit_tokens: int, miss_tokens: int, kind: str) -> float:
    """The prefill alone, in one pass: `miss_tokens` new tokens over `hit_tokens` cached ones (a full hit
    still computes its last token, the one that produces the first output)."""
    return p.costs.prefill_s(hit_tokens, max(1, miss_tokens), kind)


@dataclass(frozen=True, slots=True)
class ChunkedPrefill:
    """A prefill as the engine's scheduler runs it: `num_steps` steps of at most the token budget each,
    every step also stepping the running decodes. `stall_s`: the chunks' T_pre summed, what each running
    decode waits in all (its steps are that much longer); `ttft_s`: the steps' whole time, chunks plus
    decode steps, until the first token."""

    ttft_s: float
    stall_s: float
    num_steps: int


def chunked_prefill(
    p: AutoProfiles,
    hit_tokens: int,
    miss_tokens: int,
    kind: str,
    budget_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    decode_step_s: float = 0.0,
) -> ChunkedPrefill:
    """`miss_tokens` new tokens over `hit_tokens` cached ones in chunks of `budget_tokens` (the hit is loaded
    with the first chunk and costs no budget), next to running decodes whose step takes `decode_step_s`.
    Chunk k computes its tokens over hit + k x budget: T_pre is linear in the cached count, so the full
    chunks together cost as many chunks over their mean cached count."""
    miss = max(1, miss_tokens)
    num_full, tail = divmod(miss, budget_tokens)
    stall = p.costs.prefill_s(hit_tokens + num_full * budget_tokens, tail, kind) if tail else 0.0
    if num_full:
        mean_hit = hit_tokens + (num_full - 1) * budget_tokens / 2
        stall += num_full * p.costs.prefill_s(mean_hit, budget_tokens, kind)
    num_steps = num_full + (1 if tail else 0)
    return ChunkedPrefill(stall + num_steps * decode_step_s, stall, num_steps)


def stall_harm_s(p: AutoProfiles, stall_s: float, num_decoding: int) -> float:
    """A prefill whose chunks take `stall_s` on an engine with `num_decoding` running decodes delays each of
    them as long (each running decode is taken to outlast the prefill: the load report does not say how
    many tokens each has left)."""
    return p.itl_weight * stall_s * num_decoding


def join_harm_s(
    p: AutoProfiles, num_decoding: int, context_tokens: int, prompt_tokens: int, output_tokens: int, kind: str
) -> float:
    """One more sequence of `prompt_tokens` in a decode batch of `num_decoding` holding `context_tokens`: each
    of the request's `output_tokens` steps is slower for every running decode."""
    if num_decoding <= 0 or output_tokens <= 0:
        return 0.0
    before = p.costs.decode_step_s(num_decoding, context_tokens, kind)
    after = p.costs.decode_step_s(num_decoding + 1, context_tokens + prompt_tokens, kind)
    return p.itl_weight * max(0.0, after - before) * num_decoding * output_tokens


def holder_wait_s(p: AutoProfiles, holder_busy_s: float, holder_step_s: float) -> float:
    """How long one routed exchange waits for a busy holder. The holder's model thread runs one step at a time
    (a prefill chunk with its decode batch) and the exchanges queued meanwhile next, in one call: an exchange
    waits for the step in progress at most, and a request's exchanges (one per layer, in order) together for
    no longer than the holder's backlog, which drains as they wait."""
    if p.route is None or holder_busy_s <= 0:
        return 0.0
    return min(holder_busy_s / p.route.shape.num_layers, holder_step_s)


def route_costs_s(
    p: AutoProfiles, chunk_tokens: int, new_tokens: int, output_tokens: int, holder_queue_s: float
) -> tuple[float, float] | None:
    """(before the first token, all later decode steps together) of routing the query rows to the holder of a
    `chunk_tokens` chunk, every layer (move the query), each exchange of the prefill waiting `holder_queue_s`
    (`holder_wait_s`); None without route constants."""
    if p.route is None or chunk_tokens <= 0:
        return None
    shape = p.route.shape
    fabric = p.route.fabric(p.route_fabric)
    rows_first = max(1, new_tokens) * shape.rows_per_token
    first = shape.num_layers * route_exchange_s(
        p.route, fabric, rows_first, chunk_tokens, queue_s=holder_queue_s
    )
    step = shape.num_layers * route_exchange_s(p.route, fabric, shape.rows_per_token, chunk_tokens)
    return first, step * max(0, output_tokens - 1)

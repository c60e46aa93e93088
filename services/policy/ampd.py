"""AMPD (brief §4.1-4.2): where each prefill of a multi-round session runs, as pure functions.

A session is bound to one decode engine (DE), which keeps its KV resident between rounds (`bind_session`:
lowest KV occupancy, then fewest running, then id). Every prefill of the session (the initial one and each
incremental one after a tool call) then runs either locally on that DE (no KV moves, but the DE's decode
batch waits for it) or remotely on a prefill engine (PE), which needs the history KV first (from the DE over
the data plane, or from storage, whichever is cheaper) and sends the new KV back. `route_prefill` is the
paper's Algorithm 1:
  1. any PE whose windowed TTFT is at most alpha x the TTFT SLO (first in the caller's random order): remote;
  2. else, the DE's windowed ITL at most beta x the ITL SLO: local;
  3. else the cheapest estimate: local (Eq. 1: T_pre on the DE + its local queue) or a PE (Eq. 2: T_pre +
     history in + increment back + its queue); ties go to local, then to the lowest PE id (brief §8 #6).
The baselines are routes too: `disagg-remote` (every prefill remote, round robin or least queue: Dynamo) and
`colocated` (every prefill local on the session's engine: vLLM with prefix caching).

Pure: the caller shuffles the PEs (the paper's "random order"), measures the windows (`ampd_stats.py`) and
reads the cost model (`ampd_costs.py`). Queues are (l_hist, l_incr) pairs of prefills sent and not yet done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.policy.ampd_costs import ROLE_DECODE, ROLE_PREFILL, STORAGE, CostModel
from shared.errors import ConfigError

LOCAL = "local"  # RouteDecision.target of a prefill on the session's own decode engine
MODE_AMPD = "ampd"  # Algorithm 1
MODE_REMOTE_RR = "remote-rr"  # disagg-remote baseline, PE by round robin
MODE_REMOTE_LQ = "remote-lq"  # disagg-remote baseline, PE with the least queued work
MODE_LOCAL = "local"  # colocated baseline
MODES = (MODE_AMPD, MODE_REMOTE_RR, MODE_REMOTE_LQ, MODE_LOCAL)
# router policies with session engines: AMPD and the two baselines it is measured against
AMPD = "ampd"
DISAGG_REMOTE = "disagg-remote"
SESSION_COLOCATED = "session-colocated"
SESSION_POLICIES = (AMPD, DISAGG_REMOTE, SESSION_COLOCATED)
SOURCE_HBM = "hbm"  # history streamed from the DE's resident cache (KvPlan.read_side)
SOURCE_STORAGE = "pe"  # history read from the PE node's storage
SOURCE_NONE = ""  # no history to move: the PE computes all of it
SLACK_ORDERS = ("random", "least-queue")  # AmpdParams.slack_order

Queue = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class AmpdParams:
    """alpha, beta: slack factors of the TTFT and ITL tests (paper defaults); `route_initial`: an initial
    prefill (no history) goes through Algorithm 1 too (brief §8 #8; False: always remote); `data_link`: the
    link KV crosses between a DE and a PE (a `CostModel.links` name); `slack_order`: which PE with TTFT slack
    takes the prefill, the first in the caller's random order (the paper) or the least queued work (an
    option: the random pick unbalances few PEs whose windows lag their queues, `kvpath bench ampd --sim`)."""

    alpha: float = 0.9
    beta: float = 0.85
    route_initial: bool = True
    data_link: str = "shm"
    slack_order: str = "random"  # one of SLACK_ORDERS

    def __post_init__(self) -> None:
        if not (0 < self.alpha and 0 < self.beta):
            raise ConfigError(f"AMPD alpha={self.alpha}, beta={self.beta}: must be > 0", param="alpha")
        if self.slack_order not in SLACK_ORDERS:
            raise ConfigError(f"slack_order {self.slack_order!r}: one of {SLACK_ORDERS}", param="slack_order")


@dataclass(frozen=True, slots=True)
class TurnPrefill:
    """One prefill to route: `l_incr` new tokens over `l_hist` history tokens, of which `resident_tokens` are
    in the bound DE's cache and `stored_tokens` in storage; the request's SLOs in seconds."""

    l_hist: int
    l_incr: int
    resident_tokens: int
    stored_tokens: int
    ttft_slo_s: float
    itl_slo_s: float

    def __post_init__(self) -> None:
        if min(self.l_hist, self.l_incr, self.resident_tokens, self.stored_tokens) < 0:
            raise ConfigError(f"negative token count in {self}")
        if max(self.resident_tokens, self.stored_tokens) > self.l_hist:
            raise ConfigError(f"history sources exceed l_hist in {self}")

    @property
    def total_tokens(self) -> int:
        return self.l_hist + self.l_incr


@dataclass(frozen=True, slots=True)
class PrefillView:
    """A PE as Algorithm 1 reads it: windowed TTFT (s) and its queued prefills."""

    engine_id: str
    ttft_s: float
    queue: Queue = ()


@dataclass(frozen=True, slots=True)
class DecodeView:
    """The bound DE: windowed ITL (s) and its local prefill queue."""

    engine_id: str
    itl_s: float
    queue: Queue = ()


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """`target`: LOCAL or a PE id; `reason`: ttft_slack | itl_slack | cost | forced | only_local |
    only_remote, or the router's remote_full (the decode engine had no room for a remote turn);
    `estimate_s`: the Eq. 1/2 estimate of the chosen target; `history_source` (remote): SOURCE_HBM,
    SOURCE_STORAGE or SOURCE_NONE."""

    target: str
    reason: str
    estimate_s: float
    history_source: str = SOURCE_NONE

    @property
    def is_local(self) -> bool:
        return self.target == LOCAL


@dataclass(frozen=True, slots=True)
class DecodeOccupancy:
    """A DE as binding reads it: KV tokens held (running + resident sessions) of its total, running count."""

    engine_id: str
    used_kv_tokens: int
    total_kv_tokens: int
    num_running: int
    is_draining: bool = False


def bind_session(
    engines: Sequence[DecodeOccupancy], resident_tokens: Mapping[str, int] | None = None
) -> str | None:
    """The DE a new (or orphaned) session is bound to: lowest KV occupancy, then fewest running, then id;
    None when no DE takes work. A session the router holds no binding for whose KV is resident on a DE
    (`resident_tokens` of its prompt per DE, the index's `hbm:<engine>`: the router restarted, or another
    router replica bound it) goes back to the DE holding most of it, whatever its occupancy (idle sessions'
    KV there is evictable, and the binding that put the session there balanced it): anywhere else the turn
    would load or recompute what that DE holds."""
    live = [e for e in engines if not e.is_draining and e.total_kv_tokens > 0]
    if not live:
        return None
    resident = resident_tokens or {}
    holders = [e for e in live if resident.get(e.engine_id, 0) > 0]
    if holders:
        return min(holders, key=lambda e: (-resident[e.engine_id], _occupancy_key(e))).engine_id
    return min(live, key=_occupancy_key).engine_id


def _occupancy_key(e: DecodeOccupancy) -> tuple[float, int, str]:
    return (e.used_kv_tokens / e.total_kv_tokens, e.num_running, e.engine_id)


def policy_mode(policy: str, remote_pick: str = "rr") -> str:
    """The routing mode of a session policy (`remote_pick`: rr | least-queue for disagg-remote)."""
    if policy == AMPD:
        return MODE_AMPD
    if policy == SESSION_COLOCATED:
        return MODE_LOCAL
    if policy == DISAGG_REMOTE:
        return MODE_REMOTE_LQ if remote_pick == "least-queue" else MODE_REMOTE_RR
    raise ConfigError(f"{policy!r} is not a session policy ({', '.join(SESSION_POLICIES)})", param="policy")


# ------------------------------------------------------------------------------------------- estimates


def remote_history(turn: TurnPrefill, costs: CostModel, data_link: str) -> tuple[str, float, int]:
    """Where a PE gets the history from: (source, seconds to bring it and compute the prefill, history tokens
    it loads). Resident KV comes over the data plane, stored KV from the PE node's storage; what neither
    holds is recomputed. The cheapest wins (ties: the DE's cache)."""
    total = turn.total_tokens
    best = (SOURCE_NONE, costs.prefill_s(0, total, ROLE_PREFILL), 0)
    options = ((SOURCE_HBM, turn.resident_tokens, data_link), (SOURCE_STORAGE, turn.stored_tokens, STORAGE))
    for source, tokens, link in options:
        if tokens <= 0:
            continue
        seconds = costs.kv_s(tokens, link) + costs.prefill_s(tokens, total - tokens, ROLE_PREFILL)
        if seconds < best[1] or (seconds == best[1] and best[0] == SOURCE_NONE):
            best = (source, seconds, tokens)
    return best


def local_estimate(turn: TurnPrefill, decode: DecodeView, costs: CostModel) -> float:
    """Eq. 1: T_pre on the DE over its resident history (a history it no longer holds loads from storage
    first), plus the DE's local prefill queue."""
    total = turn.total_tokens
    if turn.resident_tokens >= turn.stored_tokens:
        run_s = costs.prefill_s(turn.resident_tokens, total - turn.resident_tokens, ROLE_DECODE)
    else:
        run_s = costs.kv_s(turn.stored_tokens, STORAGE) + costs.prefill_s(
            turn.stored_tokens, total - turn.stored_tokens, ROLE_DECODE
        )
    return run_s + costs.queue_s(decode.queue, ROLE_DECODE)


def remote_estimate(
    turn: TurnPrefill, prefill: PrefillView, costs: CostModel, data_link: str
) -> tuple[float, str]:
    """Eq. 2: history in (or recompute) + T_pre on the PE + the increment back + the PE's queue; and the
    history source it assumes."""
    source, run_s, _ = remote_history(turn, costs, data_link)
    back_s = costs.kv_s(turn.total_tokens - turn.resident_tokens, data_link)
    return run_s + back_s + costs.queue_s(prefill.queue, ROLE_PREFILL), source


# ------------------------------------------------------------------------------------------ decisions


def route_prefill(
    turn: TurnPrefill,
    decode: DecodeView,
    prefills: Sequence[PrefillView],
    costs: CostModel,
    params: AmpdParams = AmpdParams(),
) -> RouteDecision:
    """Algorithm 1. `prefills` in the caller's random order (line 1); may be empty (then local)."""
    if params.slack_order == "least-queue":
        prefills = sorted(prefills, key=lambda p: (costs.queue_s(p.queue, ROLE_PREFILL), p.engine_id))
    for pe in prefills:  # lines 1-3
        if pe.ttft_s <= params.alpha * turn.ttft_slo_s:
            return _remote(turn, pe, costs, params, "ttft_slack")
    if prefills and not params.route_initial and turn.l_hist == 0:
        return cheapest_remote(turn, prefills, costs, params, "only_remote")
    if decode.itl_s <= params.beta * turn.itl_slo_s or not prefills:  # lines 4-5
        reason = "itl_slack" if prefills else "only_local"
        return RouteDecision(LOCAL, reason, local_estimate(turn, decode, costs))
    local_s = local_estimate(turn, decode, costs)  # lines 6-9
    remote = cheapest_remote(turn, prefills, costs, params, "cost")
    if local_s <= remote.estimate_s:
        return RouteDecision(LOCAL, "cost", local_s)
    return remote


def cheapest_remote(
    turn: TurnPrefill, prefills: Sequence[PrefillView], costs: CostModel, params: AmpdParams, reason: str
) -> RouteDecision:
    """The PE with the lowest Eq. 2 estimate (ties: lowest id)."""
    best: RouteDecision | None = None
    for pe in sorted(prefills, key=lambda p: p.engine_id):
        decision = _remote(turn, pe, costs, params, reason)
        if best is None or decision.estimate_s < best.estimate_s:
            best = decision
    if best is None:
        raise ConfigError("cheapest_remote needs at least one prefill engine")
    return best


def _remote(
    turn: TurnPrefill, pe: PrefillView, costs: CostModel, params: AmpdParams, reason: str
) -> RouteDecision:
    estimate, source = remote_estimate(turn, pe, costs, params.data_link)
    return RouteDecision(pe.engine_id, reason, estimate, source)


def route_by_mode(
    mode: str,
    turn: TurnPrefill,
    decode: DecodeView,
    prefills: Sequence[PrefillView],
    costs: CostModel,
    params: AmpdParams,
    rr_cursor: int = 0,
) -> tuple[RouteDecision | None, int]:
    """The route of `mode` (one of MODES) and the round-robin cursor for the next call; None when the mode
    needs a PE and there is none. `prefills` in random order for MODE_AMPD (any order otherwise)."""
    if mode == MODE_AMPD:
        return route_prefill(turn, decode, prefills, costs, params), rr_cursor
    if mode == MODE_LOCAL:
        return RouteDecision(LOCAL, "forced", local_estimate(turn, decode, costs)), rr_cursor
    if not prefills:
        return None, rr_cursor
    ordered = sorted(prefills, key=lambda p: p.engine_id)
    if mode == MODE_REMOTE_RR:
        pe = ordered[rr_cursor % len(ordered)]
        return _remote(turn, pe, costs, params, "forced"), rr_cursor + 1
    if mode == MODE_REMOTE_LQ:
        pe = min(ordered, key=lambda p: (costs.queue_s(p.queue, ROLE_PREFILL), p.engine_id))
        return _remote(turn, pe, costs, params, "forced"), rr_cursor
    raise ConfigError(f"unknown AMPD routing mode {mode!r}; one of {', '.join(MODES)}", param="mode")

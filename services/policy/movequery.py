"""Move the query, not the cache: the route / fetch / local cost model and its predicate (pure).

A request on engine E whose prompt starts with a chunk of c_t tokens that engine H holds can (paper §4):
  route  ship its query rows to H every layer and merge the partial H sends back:
         T_route = T_probe + M_q (q + p) / BW + T_compute + T_merge     (one exchange, one layer)
  fetch  pull the chunk's KV into E's cache and attend locally:  T_fetch = T_pull + T_splice,
         T_pull = c_t b_KV L / BW_fetch
  local  recompute the chunk on E:  T_local = c_t L c
M_q counts query rows on the wire, one per (token, head), q and p their bytes (the query row; the partial's
(o, m, l)); b_KV is the KV of one token and layer. The paper's rule takes the argmin of the three per
(chunk, request); kvpath applies it per request at dispatch with the request's whole life in view (its
prefill's rows, then one token's rows per decode step, every exchange paid once per layer, since a layer's
query depends on the layer before), the requester's free KV memory after the work queued on it and the
holder's queue, and again between decode steps (`keep_routing`), when the remaining steps and the holder's
measured queue are known. Memory: fetch and local keep a private copy of the chunk, route only the request's
own tokens; a primitive whose KV (for a copy: with room for one more, `memory_need_tokens`) does not fit now
pays the wait until the requester's running requests have given back enough (`memory_wait_s`, from the
release times its load report states), so in the memory-bound fan-in a sub-agent routes when waiting for
room for a copy costs more than routing (a busy holder), and waits for the room when that costs less. A
sub-agent of a burst (others sharing the chunk arrived with it, undecided: `pending_requests`) is priced at
the burst's mean wait were all of it to take the same primitive (`burst_wait_s`).

Who calls it: the router (`services/router/route_choice.py`) at dispatch, the engine's route sessions
between steps, the simulator (`loadgen/sim/movequery*.py`) with the paper's fabrics. Constants come from a
`CostProfile` (`movequery_profile.py`): measured by `kvpath bench movequery --calibrate`, or the paper's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from shared.errors import ConfigError


class Primitive(StrEnum):
    ROUTE = "route"
    FETCH = "fetch"
    LOCAL = "local"


PRIMITIVES = tuple(Primitive)


@dataclass(frozen=True, slots=True)
class Fabric:
    """A transport pair as the route exchange sees it: the probe round trip (T_probe: an empty exchange),
    the exchange's byte rate (the large-M_q slope) and an optional fixed turnaround the paper's 2-constant
    model leaves out."""

    name: str
    t_probe_s: float
    bandwidth_bytes_per_s: float
    t_turn_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.t_probe_s >= 0 and self.t_turn_s >= 0 and self.bandwidth_bytes_per_s > 0):
            raise ConfigError(f"fabric {self.name}: probe and turnaround >= 0 and bandwidth > 0 required")

    def exchange_s(self, num_bytes: float) -> float:
        """Transport time of one exchange moving `num_bytes` both ways."""
        return self.t_probe_s + self.t_turn_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The two coefficients that carry a model into the rule (paper §4.4): the routed payload per row and the
    KV per token and layer; and how many rows a token makes (its query heads)."""

    num_layers: int
    rows_per_token: int
    query_bytes_per_row: int  # q
    partial_bytes_per_row: int  # p
    kv_bytes_per_token_layer: int  # b_KV

    @property
    def row_bytes(self) -> int:
        return self.query_bytes_per_row + self.partial_bytes_per_row


@dataclass(frozen=True, slots=True)
class Compute:
    """Time of the attention work itself: holder's partial (fixed + per key, the chunk's KV read once per
    call, + per query row x key), requester's merge (per row), local prefill of a chunk (c per token and
    layer), the splice of fetched KV (fixed + per byte into the cache)."""

    local_s_per_token_layer: float  # c
    attention_s: float = 0.0  # fixed cost of one partial-attention call
    attention_s_per_key: float = 0.0
    attention_s_per_row_key: float = 0.0
    merge_s_per_row: float = 0.0
    splice_s: float = 0.0
    splice_s_per_byte: float = 0.0


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Every constant of the model: fabrics by name, the fetch path's pull rate and fixed cost, compute."""

    shape: ModelShape
    compute: Compute
    fabrics: dict[str, Fabric] = field(default_factory=dict)
    fetch_bandwidth_bytes_per_s: float = 1e9
    fetch_fixed_s: float = 0.0  # request latency of the fetch path (storage lookup and lease), not bytes

    def fabric(self, name: str) -> Fabric:
        if name in self.fabrics:
            return self.fabrics[name]
        if not self.fabrics:
            raise ConfigError("cost profile has no fabric")
        return max(self.fabrics.values(), key=lambda f: f.t_probe_s)  # unknown pair: the slowest known


# ------------------------------------------------------------------------------------- the three primitives


def route_exchange_s(
    profile: CostProfile, fabric: Fabric, num_rows: int, chunk_tokens: int, *, queue_s: float = 0.0
) -> float:
    """One route dispatch for one layer: transport both ways, the holder's partial, the requester's merge,
    plus the time the holder's queue holds it."""
    c = profile.compute
    transport = fabric.exchange_s(num_rows * profile.shape.row_bytes)
    holder = local_attention_s(profile, num_rows, chunk_tokens)
    return transport + holder + c.merge_s_per_row * num_rows + queue_s


def fetch_s(profile: CostProfile, chunk_tokens: int) -> float:
    """T_pull + T_splice for the whole chunk (every layer)."""
    chunk_bytes = chunk_tokens * profile.shape.kv_bytes_per_token_layer * profile.shape.num_layers
    c = profile.compute
    pull = profile.fetch_fixed_s + chunk_bytes / profile.fetch_bandwidth_bytes_per_s
    return pull + c.splice_s + c.splice_s_per_byte * chunk_bytes


def local_s(profile: CostProfile, chunk_tokens: int) -> float:
    """T_local = c_t L c."""
    return chunk_tokens * profile.shape.num_layers * profile.compute.local_s_per_token_layer


def local_attention_s(profile: CostProfile, num_rows: int, chunk_tokens: int) -> float:
    """Attending the chunk here (after a fetch or a recompute), one layer: the compute a route ships away."""
    c = profile.compute
    return c.attention_s + (c.attention_s_per_key + c.attention_s_per_row_key * num_rows) * chunk_tokens


# ------------------------------------------------------------------------------------------- the predicate


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One (request, chunk) pair as the predicate sees it."""

    chunk_tokens: int  # c_t: the held prefix this request shares
    new_tokens: int  # prompt tokens after the chunk (computed on the requester whatever the choice)
    decode_steps: int  # tokens it will generate (max_tokens: an upper bound)
    # the requester's free cache after the work queued on it (None: unknown, assume room)
    free_kv_tokens: int | None = None
    # when the requester's running requests give their KV back: (seconds from now, tokens), soonest first
    # (each at its answer's upper bound, from the requester's load report); empty: not known
    kv_release: tuple[tuple[float, int], ...] = ()
    holder_queue_s: float = 0.0  # how long the holder's queue holds an exchange now (measured)
    # requests sharing the chunk that reached the router with this one and are not decided yet (a burst of
    # sub-agents), counted for this requester (None: not known, so a backlog keeps copies out); its whole
    # cache, and its decode step besides the chunk's attention (how long a request stays in memory)
    pending_requests: int | None = None
    holder_burst: int = 0  # the burst's others on every requester, which would route to the same holder
    kv_capacity_tokens: int = 0
    decode_step_s: float = 0.0
    can_route: bool = True  # a live holder and a requester that speaks the protocol
    can_fetch: bool = True  # the chunk is in the store


@dataclass(frozen=True, slots=True)
class Choice:
    primitive: Primitive
    costs_s: dict[str, float]  # expected extra time of the request per primitive (inf: infeasible)
    ttft_s: dict[str, float]  # the part paid before the first token


def request_costs(
    profile: CostProfile, fabric: Fabric, req: RouteRequest
) -> tuple[dict[str, float], dict[str, float]]:
    """(total, before the first token) seconds each primitive adds to the request over having the chunk's KV
    in the cache for free; inf where it cannot be used."""
    shape = profile.shape
    layers, rows = shape.num_layers, shape.rows_per_token
    prefill_rows = max(1, req.new_tokens) * rows
    steps = max(0, req.decode_steps - 1)  # the first token comes out of the prefill
    route_first = layers * route_exchange_s(
        profile, fabric, prefill_rows, req.chunk_tokens, queue_s=req.holder_queue_s
    )
    route_step = layers * route_exchange_s(
        profile, fabric, rows, req.chunk_tokens, queue_s=req.holder_queue_s
    )
    attend_first = layers * local_attention_s(profile, prefill_rows, req.chunk_tokens)
    attend_step = layers * local_attention_s(profile, rows, req.chunk_tokens)
    first = {
        Primitive.ROUTE: route_first,
        Primitive.FETCH: fetch_s(profile, req.chunk_tokens) + attend_first,
        Primitive.LOCAL: local_s(profile, req.chunk_tokens) + attend_first,
    }
    total = {
        Primitive.ROUTE: route_first + steps * route_step,
        Primitive.FETCH: first[Primitive.FETCH] + steps * attend_step,
        Primitive.LOCAL: first[Primitive.LOCAL] + steps * attend_step,
    }
    if req.pending_requests and req.holder_burst > 0:  # the burst's other routes share the holder
        prefill_s, decode_s = holder_burst_s(profile, req)
        first[Primitive.ROUTE] += prefill_s
        total[Primitive.ROUTE] += prefill_s + decode_s
    stays = {p: total[p] + req.decode_steps * req.decode_step_s for p in PRIMITIVES}
    for p, wait in _memory_waits_s(req, stays).items():
        first[p] += wait
        total[p] += wait
    infeasible = set()
    if not req.can_route:
        infeasible.add(Primitive.ROUTE)
    if not req.can_fetch:
        infeasible.add(Primitive.FETCH)
    for p in infeasible:
        total[p] = first[p] = math.inf
    return {str(k): v for k, v in total.items()}, {str(k): v for k, v in first.items()}


def holder_burst_s(profile: CostProfile, req: RouteRequest) -> tuple[float, float]:
    """What the rest of a burst (`holder_burst` others) adds to a routed request's time were all of it to
    route: (before its first token, after it). The holder attends every sub-agent's prefill rows over the
    chunk, on average half the others' before this one's, then every routed row at each decoding step.
    A fast holder (a GPU) makes this small; a holder that computes on the requesters' cores does not."""
    shape = profile.shape
    rows, others = shape.rows_per_token, req.holder_burst
    prefill_rows = max(1, req.new_tokens) * rows
    prefill_s = others * shape.num_layers * local_attention_s(profile, prefill_rows, req.chunk_tokens) / 2
    per_step = shape.num_layers * profile.compute.attention_s_per_row_key * rows * req.chunk_tokens * others
    return prefill_s, max(0, req.decode_steps - 1) * per_step


def _memory_waits_s(req: RouteRequest, stays_s: dict[Primitive, float]) -> dict[Primitive, float]:
    """Each primitive's wait for the requester's memory: this request's own (`memory_wait_s`), or with others
    of its burst still undecided, the burst's mean (`burst_wait_s`). Without a holder to route to the wait
    does not decide (fetch and local keep the same KV, and the engine queues either); when not even the
    request's own tokens have a known release time, route, which needs the least, is taken to go first."""
    if req.pending_requests:
        waits = {p: burst_wait_s(p, req, stays_s[p]) for p in PRIMITIVES}
    else:
        waits = {p: memory_wait_s(req, memory_need_tokens(p, req)) for p in PRIMITIVES}
    if not req.can_route:
        return dict.fromkeys(PRIMITIVES, 0.0)
    if math.isinf(waits[Primitive.ROUTE]):
        return {p: 0.0 if p is Primitive.ROUTE else math.inf for p in PRIMITIVES}
    backlog = req.free_kv_tokens is not None and req.free_kv_tokens < 0
    if backlog and not req.pending_requests:  # no burst to weigh: a copy would wait out of turn
        waits[Primitive.FETCH] = waits[Primitive.LOCAL] = math.inf
    return waits


def memory_wait_s(req: RouteRequest, need_tokens: int) -> float:
    """How long a request that keeps `need_tokens` of KV on the requester waits for memory: 0 while the free
    KV (after the work queued there, which goes first) holds it, else until the requester's running requests
    have released the shortfall (`kv_release`, counted at the answers' upper bounds). Past the last known
    release the queued work is taken to run and release at the same pace; inf when no release is known."""
    if req.free_kv_tokens is None or req.free_kv_tokens >= need_tokens:
        return 0.0
    short = need_tokens - req.free_kv_tokens
    released, last_s = 0, 0.0
    for at_s, tokens in req.kv_release:
        released, last_s = released + tokens, max(last_s, at_s)
        if released >= short:
            return last_s
    if released <= 0 or last_s <= 0:
        return math.inf
    return last_s * short / released


def burst_wait_s(primitive: Primitive | str, req: RouteRequest, stay_s: float) -> float:
    """The mean wait for the requester's memory over a burst, this request and the `pending_requests` that
    arrived with it, were each of them to take `primitive` and keep its KV (`resident_kv_tokens`) for
    `stay_s`: as many as the free KV holds start now; the next ones once memory frees (the first release
    that covers one, `memory_wait_s`, or the burst's own first finish), then as many as the whole cache
    holds every `stay_s`. A private copy of the chunk keeps several times a routed request's KV, so a
    burst larger than the cache's copies prices copies at the waves they queue in, and a burst that fits
    (or turns over fast: short answers) keeps them."""
    n = (req.pending_requests or 0) + 1
    need = resident_kv_tokens(primitive, req)
    free = req.free_kv_tokens
    if free is None:
        return 0.0
    now = max(0, free) // need
    if now >= n:
        return 0.0
    per_wave = max(1, (req.kv_capacity_tokens or max(free, need)) // need)
    first_s = memory_wait_s(replace(req, free_kv_tokens=free - now * need), need)  # running ones' releases
    if now > 0:
        first_s = min(first_s, stay_s)  # or the burst's own first finish
    if math.isinf(first_s):
        return math.inf
    waits = sum(first_s + (j - now) // per_wave * stay_s for j in range(now, n))
    return waits / n


def resident_kv_tokens(primitive: Primitive | str, req: RouteRequest) -> int:
    """KV tokens the request keeps in the requester's cache under `primitive`: its own tokens, plus the
    chunk unless it is routed (the chunk then stays on the holder)."""
    own = req.new_tokens + req.decode_steps
    return own if Primitive(primitive) is Primitive.ROUTE else own + req.chunk_tokens


def memory_need_tokens(primitive: Primitive | str, req: RouteRequest) -> int:
    """The requester's free KV a primitive waits for: what it keeps (`resident_kv_tokens`), and for fetch
    and local room for one more copy of the chunk besides. That margin is the fan-in's: the next request
    sharing the chunk would otherwise queue for memory behind a copy (or preempt a running request), which
    route, keeping only its own tokens, avoids; so a copy is taken only while it leaves room to route."""
    need = resident_kv_tokens(primitive, req)
    return need if Primitive(primitive) is Primitive.ROUTE else need + req.chunk_tokens


def can_take_chunk(req: RouteRequest) -> bool:
    """Whether fetch or local (a private copy of the chunk) needs no wait for the requester's memory; in view
    of a burst (`pending_requests`), only while the whole burst's copies fit."""
    if req.pending_requests and req.free_kv_tokens is not None:
        copy = resident_kv_tokens(Primitive.FETCH, req)
        if max(0, req.free_kv_tokens) // copy <= req.pending_requests:
            return False
    return memory_wait_s(req, memory_need_tokens(Primitive.FETCH, req)) == 0.0


def choose(profile: CostProfile, fabric: Fabric, req: RouteRequest) -> Choice:
    """argmin over route / fetch / local of the request's expected extra time (ties: local, fetch, route:
    the primitive that depends on the fewest other parties). Local is always possible."""
    total, first = request_costs(profile, fabric, req)
    if all(math.isinf(v) for v in total.values()):
        total[Primitive.LOCAL] = first[Primitive.LOCAL] = local_s(profile, req.chunk_tokens)
    order = (Primitive.LOCAL, Primitive.FETCH, Primitive.ROUTE)
    best = min(order, key=lambda p: total[p])
    return Choice(best, total, first)


def take_chunk_now(*, remaining_steps: int, route_step_s: float, local_step_s: float, take_s: float) -> bool:
    """Stop routing and take the chunk here (fetch or recompute, `take_s` once) when the remaining steps at
    the route's price cost more than that plus attending locally."""
    return remaining_steps * (route_step_s - local_step_s) > take_s


def keep_routing(
    profile: CostProfile,
    fabric: Fabric,
    *,
    chunk_tokens: int,
    remaining_steps: int,
    measured_step_s: float | None = None,
    holder_queue_s: float = 0.0,
    can_fetch: bool = True,
) -> bool:
    """Between decode steps of a routed request: keep routing, or take the chunk here now (fetch, else
    recompute) because the remaining steps at the route's current price (measured, or predicted with the
    holder's queue) cost more than taking it once and attending locally."""
    rows, layers = profile.shape.rows_per_token, profile.shape.num_layers
    step = measured_step_s
    if step is None:
        step = layers * route_exchange_s(profile, fabric, rows, chunk_tokens, queue_s=holder_queue_s)
    local_step = layers * local_attention_s(profile, rows, chunk_tokens)
    take = fetch_s(profile, chunk_tokens) if can_fetch else local_s(profile, chunk_tokens)
    take = min(take, local_s(profile, chunk_tokens))
    return not take_chunk_now(
        remaining_steps=remaining_steps, route_step_s=step, local_step_s=local_step, take_s=take
    )


# ------------------------------------------------------------------------------------------- crossovers


def byte_break_even_rows(shape: ModelShape, chunk_tokens: int) -> float:
    """M_q where one layer's routed bytes equal one layer's chunk: c_t b_KV / (q + p) (paper §5.2)."""
    return chunk_tokens * shape.kv_bytes_per_token_layer / shape.row_bytes


def route_fetch_crossover_rows(profile: CostProfile, fabric: Fabric, chunk_tokens: int) -> float:
    """M_q at which one route exchange costs as much as fetching the chunk (paper §5.5: ~1e5 on IBGDA)."""
    per_row = profile.shape.row_bytes / fabric.bandwidth_bytes_per_s
    c = profile.compute
    per_row += c.attention_s_per_row_key * chunk_tokens + c.merge_s_per_row
    fixed = fabric.t_probe_s + fabric.t_turn_s + c.attention_s + c.attention_s_per_key * chunk_tokens
    return max(0.0, (fetch_s(profile, chunk_tokens) - fixed) / per_row)


def local_fetch_crossover_tokens(profile: CostProfile) -> float:
    """c_t below which recomputing the chunk is cheaper than fetching it (paper: ~75-220 tokens)."""
    shape, c = profile.shape, profile.compute
    per_token_fetch = float(shape.kv_bytes_per_token_layer * shape.num_layers)
    per_token_fetch *= 1 / profile.fetch_bandwidth_bytes_per_s + c.splice_s_per_byte
    per_token_local = shape.num_layers * c.local_s_per_token_layer
    fixed = profile.fetch_fixed_s + c.splice_s
    if per_token_local <= per_token_fetch:
        return math.inf
    return fixed / (per_token_local - per_token_fetch)

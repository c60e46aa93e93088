"""The `auto` policy: one cost model chooses among every KV path of a request (pure).

Each paper kvpath implements answers one question with its own rule: DualPath picks a read side, Beluga makes
placement cache-oblivious, AMPD picks local vs remote prefill, move-the-query picks route vs fetch vs local.
`plan(request, snapshot, profiles)` answers them together: it enumerates the feasible plans

  where    `local`: the engine that decodes also prefills (a colocated engine, or a decode engine running
           the prefill itself, AMPD's local path); `remote`: a prefill engine prefills and hands the KV over
  source   where the hit KV comes from: `hbm` resident on the decoding engine (streamed to the prefill
           engine when remote), the shared `pool`, `storage` read on the prefilling engine's node,
           `storage-de` read on the decode engine's node and streamed over (DualPath's DE path), `route` the
           query rows to a holder of the prefix (move the query), or `recompute` it

and prices each with `auto_costs.py` as predicted TTFT plus ITL harm to running decodes. It takes the
cheapest plan whose TTFT meets the request's SLO, else the one that misses it least (smallest TTFT), and
returns it with the runner-up (the best plan of another path) for explanation.

Who calls it: the router's auto dispatch (`services/router/auto_dispatch.py`, on colocated engines or on
prefill/decode engines through `auto_pd.py`) once per request, the simulator (`loadgen/sim/auto/`) for each
arrival. The running topology says which paths exist (`AutoSnapshot.sources`, `local_on_decode`); a path it
does not offer is never enumerated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from services.policy import auto_costs as terms
from services.policy.auto_costs import DEFAULT_MAX_NUM_BATCHED_TOKENS, AutoProfiles, ChunkedPrefill
from services.policy.snapshot import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL

AUTO = "auto"
LOCAL = "local"
REMOTE = "remote"


class Source(StrEnum):
    HBM = "hbm"
    POOL = "pool"
    STORAGE = "storage"
    STORAGE_DE = "storage-de"
    ROUTE = "route"
    RECOMPUTE = "recompute"


ALL_SOURCES = frozenset(Source)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine as the estimator sees it: queued prefill (new tokens; `queued_prefill_s` when the engine
    or the router knows it in seconds, which prices a queue of many requests better than one token count),
    its running decode batch, how long its data-plane link is still busy, and its prefill token budget per
    step (`max_num_batched_tokens`: a longer prefill runs in chunks, each next to the running decodes)."""

    engine_id: str
    role: str
    node: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_s: float | None = None
    num_decoding: int = 0
    decode_context_tokens: int = 0
    link_busy_s: float = 0.0
    is_draining: bool = False
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass(frozen=True, slots=True)
class AutoSnapshot:
    """The live load: engines, pending storage reads per node (a node absent: no live storage there), pending
    pool reads (None: no pool), and the paths the running topology offers."""

    engines: tuple[EngineLoad, ...]
    read_queue_tokens: Mapping[int, int] = field(default_factory=dict)
    pool_queue_tokens: int | None = None
    sources: frozenset[Source] = ALL_SOURCES
    local_on_decode: bool = True


@dataclass(frozen=True, slots=True)
class AutoRequest:
    """A request as the estimator sees it: its prompt and expected output, how much of its prefix each tier
    holds (storage and pool: one number each; HBM and holders: per engine), its TTFT SLO (None: none)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int = 1
    storage_hit_tokens: int = 0
    pool_hit_tokens: int = 0
    resident_tokens: Mapping[str, int] = field(default_factory=dict)
    held_tokens: Mapping[str, int] = field(default_factory=dict)
    ttft_slo_s: float | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """One priced way to serve the request. `hit_tokens` come from `source` (at `source_at`: an engine id or
    `node:<n>`, "" for none); the rest is prefilled on `prefill_engine`; `decode_engine` decodes."""

    where: str
    source: Source
    prefill_engine: str
    decode_engine: str
    hit_tokens: int
    source_at: str
    ttft_s: float
    harm_s: float

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.harm_s

    @property
    def label(self) -> str:
        """The path, without engines: what `kvpath_router_plan_total{plan}` counts."""
        return path_label(self.where, self.source)


def path_label(where: str, source: Source) -> str:
    return f"{where}/{source.value}"


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: Plan
    runner_up: Plan | None
    num_plans: int
    meets_slo: bool


@dataclass(frozen=True, slots=True)
class _Hit:
    source: Source
    tokens: int
    ready_s: float  # when the hit KV is at the prefilling engine
    at: str


def plan(request: AutoRequest, snapshot: AutoSnapshot, profiles: AutoProfiles) -> Decision | None:
    """The cheapest plan meeting the SLO (else the smallest TTFT) and the runner-up; None: no engine."""
    plans = enumerate_plans(request, snapshot, profiles)
    return choose(plans, request.ttft_slo_s)


def choose(plans: list[Plan], ttft_slo_s: float | None) -> Decision | None:
    if not plans:
        return None

    def rank(x: Plan) -> tuple[bool, float, float, str, str, str]:
        misses = ttft_slo_s is not None and x.ttft_s > ttft_slo_s
        first = x.ttft_s if misses else x.cost_s
        return misses, first, x.ttft_s, x.label, x.prefill_engine, x.decode_engine

    ranked = sorted(plans, key=rank)
    best = ranked[0]
    runner = next((x for x in ranked[1:] if x.label != best.label), ranked[1] if len(ranked) > 1 else None)
    meets = ttft_slo_s is None or best.ttft_s <= ttft_slo_s
    return Decision(best, runner, len(plans), meets)


def enumerate_plans(request: AutoRequest, snapshot: AutoSnapshot, profiles: AutoProfiles) -> list[Plan]:
    live = [e for e in snapshot.engines if not e.is_draining]
    decoders = [e for e in live if e.role in (ROLE_DECODE, ROLE_COLOCATED)]
    prefillers = [e for e in live if e.role == ROLE_PREFILL]
    plans: list[Plan] = []
    for d in decoders:
        if d.role == ROLE_COLOCATED or snapshot.local_on_decode:
            plans += _local_plans(request, snapshot, profiles, d)
            plans += _route_plans(request, snapshot, profiles, d)
        for pe in prefillers:
            plans += _remote_plans(request, snapshot, profiles, pe, d)
    return plans


def _shared_hits(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles, node: int) -> list[_Hit]:
    """Hits every engine reaches the same way: recompute, the pool, storage on `node`."""
    hits = [_Hit(Source.RECOMPUTE, 0, 0.0, "")]
    if snap.pool_queue_tokens is not None and req.pool_hit_tokens > 0:
        ready = terms.read_s(p, p.pool_link, snap.pool_queue_tokens, req.pool_hit_tokens)
        hits.append(_Hit(Source.POOL, req.pool_hit_tokens, ready, "pool"))
    if node in snap.read_queue_tokens and req.storage_hit_tokens > 0:
        ready = terms.read_s(p, p.storage_link, snap.read_queue_tokens[node], req.storage_hit_tokens)
        hits.append(_Hit(Source.STORAGE, req.storage_hit_tokens, ready, f"node:{node}"))
    return hits


def _local_plans(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles, d: EngineLoad) -> list[Plan]:
    hits = _shared_hits(req, snap, p, d.node)
    resident = min(req.prompt_tokens, req.resident_tokens.get(d.engine_id, 0))
    if resident > 0:
        hits.append(_Hit(Source.HBM, resident, 0.0, d.engine_id))
    queue_s = _queue_s(p, d)
    join = _join_harm(req, p, d)
    plans = []
    for hit in hits:
        if hit.source not in snap.sources:
            continue
        pre = _prefill(p, d, hit.tokens, req.prompt_tokens - hit.tokens)
        ttft = p.calibrated(max(queue_s, hit.ready_s) + pre.ttft_s, path_label(LOCAL, hit.source))
        harm = terms.stall_harm_s(p, pre.stall_s, d.num_decoding) + join
        plans.append(Plan(LOCAL, hit.source, d.engine_id, d.engine_id, hit.tokens, hit.at, ttft, harm))
    return plans


def _route_plans(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles, d: EngineLoad) -> list[Plan]:
    """Route the query rows of the held prefix to its holder; `d` prefills and decodes the rest."""
    if Source.ROUTE not in snap.sources:
        return []
    loads = {e.engine_id: e for e in snap.engines if not e.is_draining}
    queue_s = _queue_s(p, d)
    plans = []
    for holder, held in sorted(req.held_tokens.items()):
        chunk = min(held, req.prompt_tokens - 1)
        if holder == d.engine_id or holder not in loads or chunk <= 0:
            continue
        h = loads[holder]
        wait_s = terms.holder_wait_s(p, _queue_s(p, h), _prefill(p, h, 0, h.max_num_batched_tokens).ttft_s)
        costs = terms.route_costs_s(p, chunk, req.prompt_tokens - chunk, req.output_tokens, wait_s)
        if costs is None:
            continue
        first, later = costs
        pre = _prefill(p, d, 0, req.prompt_tokens - chunk)
        stall = terms.stall_harm_s(p, pre.stall_s + first, d.num_decoding)
        harm = stall + _join_harm(req, p, d) + p.itl_weight * later
        ttft = p.calibrated(queue_s + pre.ttft_s + first, path_label(LOCAL, Source.ROUTE))
        plans.append(Plan(LOCAL, Source.ROUTE, d.engine_id, d.engine_id, chunk, holder, ttft, harm))
    return plans


def _remote_hits(
    req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles, pe: EngineLoad, d: EngineLoad
) -> list[_Hit]:
    hits = _shared_hits(req, snap, p, pe.node)
    resident = min(req.prompt_tokens, req.resident_tokens.get(d.engine_id, 0))
    if resident > 0:
        hits.append(_Hit(Source.HBM, resident, terms.link_s(p, resident, d.link_busy_s), d.engine_id))
    if d.node != pe.node and d.node in snap.read_queue_tokens and req.storage_hit_tokens > 0:
        tokens = req.storage_hit_tokens
        read = terms.read_s(p, p.storage_link, snap.read_queue_tokens[d.node], tokens)
        hits.append(
            _Hit(Source.STORAGE_DE, tokens, read + terms.link_s(p, tokens, d.link_busy_s), f"node:{d.node}")
        )
    return hits


def _remote_plans(
    req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles, pe: EngineLoad, d: EngineLoad
) -> list[Plan]:
    queue_s = _queue_s(p, pe)
    join = _join_harm(req, p, d)
    plans = []
    for hit in _remote_hits(req, snap, p, pe, d):
        if hit.source not in snap.sources:
            continue
        pre = _prefill(p, pe, hit.tokens, req.prompt_tokens - hit.tokens)
        kept = hit.tokens if hit.source is Source.HBM else 0  # the decode engine already holds these
        handoff = terms.link_s(p, req.prompt_tokens - kept, pe.link_busy_s)
        ttft = p.calibrated(max(queue_s, hit.ready_s) + pre.ttft_s + handoff, path_label(REMOTE, hit.source))
        plans.append(Plan(REMOTE, hit.source, pe.engine_id, d.engine_id, hit.tokens, hit.at, ttft, join))
    return plans


def _join_harm(req: AutoRequest, p: AutoProfiles, d: EngineLoad) -> float:
    return terms.join_harm_s(
        p, d.num_decoding, d.decode_context_tokens, req.prompt_tokens, req.output_tokens, d.role
    )


def _decode_step_s(p: AutoProfiles, e: EngineLoad) -> float:
    return p.costs.decode_step_s(e.num_decoding, e.decode_context_tokens, e.role)


def _prefill(p: AutoProfiles, e: EngineLoad, hit_tokens: int, miss_tokens: int) -> ChunkedPrefill:
    """A prefill on `e` as its scheduler runs it: chunks of its budget, each step with its decode batch."""
    step_s = _decode_step_s(p, e)
    return terms.chunked_prefill(p, hit_tokens, miss_tokens, e.role, e.max_num_batched_tokens, step_s)


def _queue_s(p: AutoProfiles, e: EngineLoad) -> float:
    if e.queued_prefill_s is not None:
        return e.queued_prefill_s
    step_s = _decode_step_s(p, e)
    return terms.prefill_queue_s(p, e.queued_prefill_tokens, e.role, e.max_num_batched_tokens, step_s)

"""The policies `kvpath bench auto` compares, each as a rule over the same enumerated plans.

Every fixed policy sees the plans `services/policy/auto.enumerate_plans` lists and picks one by its own rule,
never by the estimator's price, so the comparison isolates the decision:

  dualpath     prefill remote on the PE with the fewest queued tokens, decode on the DE with the fewest
               running decodes, the hit read from storage on the side with the shorter read queue
  basic        the same, always reading on the PE's node
  ampd         the session's decode engine (where its KV is resident, else the least busy); prefill remote on
               the least-queued PE while its queue leaves slack (alpha x the TTFT SLO), else local
  beluga       colocated, least loaded (`pick_least_loaded`), the hit read from the shared pool
  cache-aware  colocated, Dynamo-style overlap (`pick_cache_aware`) over HBM-resident prefixes, else storage
  route        colocated, least loaded, the held prefix reached by routing the query (move the query)
  auto         `services/policy/auto.plan` on the colocated engines (`kvpath up --policy auto --engines 4
               --kv-tier pool`, the router and engines with `--move-query`, as `kvpath bench auto --live`
               starts its fan-in): every engine decodes, so the fan-in's sub-agents decode on all four as
               under `route`, with the paths the live router offers there (the engine's HBM, the pool,
               storage on its node, recompute, routing to the holder). On P/D engines the live router offers
               no routing and no decode engine that prefills locally and also reads on its node for a PE
               (`services/router/auto_pd.py` PD_PATHS), and only two of the four GPUs would decode.
"""

from __future__ import annotations

from collections.abc import Callable

from services.policy.auto import LOCAL, REMOTE, AutoRequest, AutoSnapshot, Plan, Source, enumerate_plans, plan
from services.policy.auto_costs import AutoProfiles
from services.policy.colocated import pick_cache_aware, pick_least_loaded
from services.policy.snapshot import EngineSnapshot

AMPD_ALPHA = 0.9
Policy = Callable[[AutoRequest, AutoSnapshot, AutoProfiles], Plan]


def _pick(plans: list[Plan], where: str, pe: str, de: str, order: tuple[Source, ...]) -> Plan:
    """The plan of `where` on (pe, de) with the first available source of `order` (recompute last)."""
    mine = {
        x.source: x for x in plans if x.where == where and x.prefill_engine == pe and x.decode_engine == de
    }
    for source in (*order, Source.RECOMPUTE):
        if source in mine:
            return mine[source]
    raise AssertionError(f"no {where} plan on {pe}/{de}")


def _least(snap: AutoSnapshot, role: str, key: Callable[..., tuple[int, ...]]) -> str:
    engines = [e for e in snap.engines if e.role == role and not e.is_draining]
    return min(engines, key=lambda e: (*key(e), e.engine_id)).engine_id


def _pe(snap: AutoSnapshot) -> str:
    return _least(snap, "prefill", lambda e: (e.queued_prefill_tokens,))


def _de(snap: AutoSnapshot) -> str:
    return _least(snap, "decode", lambda e: (e.num_decoding, e.decode_context_tokens))


def dualpath(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles, *, basic: bool = False) -> Plan:
    plans = enumerate_plans(req, snap, p)
    pe, de = _pe(snap), _de(snap)
    node = {e.engine_id: e.node for e in snap.engines}
    queues = snap.read_queue_tokens
    de_side = not basic and queues.get(node[de], 0) < queues.get(node[pe], 0)
    return _pick(plans, REMOTE, pe, de, (Source.STORAGE_DE,) if de_side else (Source.STORAGE,))


def basic(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles) -> Plan:
    return dualpath(req, snap, p, basic=True)


def ampd(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles) -> Plan:
    plans = enumerate_plans(req, snap, p)
    resident = [e for e in snap.engines if e.role == "decode" and req.resident_tokens.get(e.engine_id)]
    de = max(resident, key=lambda e: req.resident_tokens[e.engine_id]).engine_id if resident else _de(snap)
    pe = _pe(snap)
    queue_s = next(e for e in snap.engines if e.engine_id == pe).queued_prefill_tokens
    slack = req.ttft_slo_s is None or p.costs.prefill_s(0, queue_s) < AMPD_ALPHA * req.ttft_slo_s
    if slack:
        return _pick(plans, REMOTE, pe, de, (Source.HBM, Source.STORAGE))
    return _pick(plans, LOCAL, de, de, (Source.HBM, Source.STORAGE))


def _snapshots(snap: AutoSnapshot) -> list[EngineSnapshot]:
    return [
        EngineSnapshot(
            e.engine_id,
            e.role,
            e.node,
            e.engine_id,
            e.num_decoding,
            e.queued_prefill_tokens + e.decode_context_tokens,
            is_draining=e.is_draining,
        )
        for e in snap.engines
    ]


def beluga(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles) -> Plan:
    engine = pick_least_loaded(_snapshots(snap))
    assert engine is not None
    return _pick(enumerate_plans(req, snap, p), LOCAL, engine, engine, (Source.POOL, Source.STORAGE))


def cache_aware(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles) -> Plan:
    engine = pick_cache_aware(_snapshots(snap), req.resident_tokens, req.prompt_tokens)
    assert engine is not None
    return _pick(enumerate_plans(req, snap, p), LOCAL, engine, engine, (Source.HBM, Source.STORAGE))


def route(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles) -> Plan:
    engine = pick_least_loaded(_snapshots(snap))
    assert engine is not None
    return _pick(
        enumerate_plans(req, snap, p), LOCAL, engine, engine, (Source.ROUTE, Source.HBM, Source.STORAGE)
    )


def auto(req: AutoRequest, snap: AutoSnapshot, p: AutoProfiles) -> Plan:
    decision = plan(req, snap, p)
    assert decision is not None
    return decision.chosen


# policy -> (its rule, the topology it runs on)
POLICIES: dict[str, tuple[Policy, str]] = {
    "dualpath": (dualpath, "pd"),
    "basic": (basic, "pd"),
    "ampd": (ampd, "pd"),
    "beluga": (beluga, "colocated"),
    "cache-aware": (cache_aware, "colocated"),
    "route": (route, "colocated"),
    "auto": (auto, "colocated"),
}

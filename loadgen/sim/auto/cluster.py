"""A simulated cluster that offers every KV path, and the execution of one `Plan` on it (pure, seeded).

Resources are FIFO servers with a busy-until time: each engine's compute, each engine's data-plane link,
each node's storage NIC, the shared pool. An engine prefills as its scheduler does (`services/engine/
scheduler.py`): in chunks of its token budget (`max_num_batched_tokens`), each step one chunk plus one token
of every running decode, so a step takes the chunk's T_pre plus the batch's T_dec and a running decode waits
the T_pre of each chunk it shares a step with (one that ends mid-prefill waits only for the chunks before).
Tiers: storage keeps every turn's KV, the pool the most recently written up to its capacity, each decoding
engine its sessions' KV in HBM up to its capacity (LRU), and the fan-in holder its pinned document. A turn's
prompt is in the tiers from its first token on, its output once the turn finished: the engines write every
block that fills during the prefill (`services/engine/colocated_connector.py`), so a request that arrives
while an earlier one on the same prefix still decodes hits it. Times are the profiles'
(`AutoProfiles.costs`) with seeded lognormal noise, so the policy's predictions are checked against a run that
is not its own formula.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from services.policy.auto import AutoRequest, AutoSnapshot, EngineLoad, Plan, Source
from services.policy.auto_costs import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    AutoProfiles,
    holder_wait_s,
    route_costs_s,
)
from services.policy.snapshot import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL

PD = "pd"  # prefill and decode engines; decode engines may also prefill (AMPD's local path)
COLOCATED = "colocated"  # every engine prefills and decodes


@dataclass(frozen=True, slots=True)
class ClusterShape:
    topology: str = PD
    nodes: int = 2
    engines_per_node: int = 2  # pd: one prefill and one decode engine per node
    hbm_tokens: int = 600_000  # KV one engine keeps resident for sessions
    pool_tokens: int = 1_500_000
    noise: float = 0.1  # lognormal sigma on every service time
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # each engine's prefill tokens per step


@dataclass(slots=True)
class Engine:
    engine_id: str
    role: str
    node: int
    free_at: float = 0.0
    link_free_at: float = 0.0
    queued: list[tuple[float, int]] = field(default_factory=list)  # (done at, new tokens)
    # request -> [end, context tokens, seconds per output token]
    decodes: dict[str, list[float]] = field(default_factory=dict)
    resident: OrderedDict[str, int] = field(default_factory=OrderedDict)
    pinned: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Started:
    """What executing a plan started: the first token's time and the decode engine."""

    first_token_s: float
    decode_engine: str


class SimCluster:
    def __init__(self, shape: ClusterShape, profiles: AutoProfiles, seed: int, holder_key: str) -> None:
        self.shape, self.p = shape, profiles
        self.rng = np.random.default_rng([seed, 21])
        self.engines = _engines(shape)
        self.storage_free_at = dict.fromkeys(range(shape.nodes), 0.0)
        self.storage_queue: dict[int, list[tuple[float, int]]] = {n: [] for n in range(shape.nodes)}
        self.pool_free_at = 0.0
        self.pool_queue: list[tuple[float, int]] = []
        self.storage: dict[str, int] = {}
        self.pool: OrderedDict[str, int] = OrderedDict()
        self.holder_key = holder_key
        self.prefilled: list[tuple[float, str, str, int]] = []  # (first token at, key, engine, tokens): due
        self.holder = next(e for e in self.engines.values() if e.role != ROLE_PREFILL)

    def pin(self, key: str, tokens: int) -> None:
        """The holder keeps `key` resident (the fan-in document); storage keeps it too."""
        self.holder.pinned[key] = tokens
        self.storage[key] = tokens

    # ------------------------------------------------------------------------------------ what a policy sees

    def snapshot(self, now: float) -> AutoSnapshot:
        budget = self.shape.max_num_batched_tokens
        loads = tuple(_load(e, now, budget) for e in self.engines.values())
        reads = {n: _pending(q, now) for n, q in self.storage_queue.items()}
        local_ok = self.shape.topology == PD
        return AutoSnapshot(loads, reads, _pending(self.pool_queue, now), local_on_decode=local_ok)

    def advance(self, now: float) -> None:
        """Prompts whose first token is out by `now` are in the tiers."""
        due = [x for x in self.prefilled if x[0] <= now]
        self.prefilled = [x for x in self.prefilled if x[0] > now]
        for _, key, engine_id, tokens in sorted(due):
            self._commit(engine_id, key, tokens)

    def request(self, rid: str, key: str, prompt: int, output: int, slo: float | None) -> AutoRequest:
        resident = {}
        for e in self.engines.values():
            tokens = max(e.resident.get(key, 0), e.pinned.get(key, 0))
            if tokens:
                resident[e.engine_id] = min(prompt, tokens)
        held = {self.holder.engine_id: self.holder.pinned[key]} if key in self.holder.pinned else {}
        return AutoRequest(
            rid,
            prompt,
            output,
            min(prompt, self.storage.get(key, 0)),
            min(prompt, self.pool.get(key, 0)),
            resident,
            held,
            slo,
        )

    # ------------------------------------------------------------------------------------------ execution

    def _t(self, seconds: float) -> float:
        sigma = self.shape.noise
        return seconds * float(np.exp(self.rng.normal(-sigma * sigma / 2, sigma))) if sigma > 0 else seconds

    def _serve(self, free_at: float, now: float, seconds: float) -> float:
        return max(free_at, now) + self._t(seconds)

    def _ready(self, plan: Plan, req: AutoRequest, now: float) -> float:
        """When the plan's hit KV is at its prefill engine."""
        costs, tokens = self.p.costs, plan.hit_tokens
        pe, de = self.engines[plan.prefill_engine], self.engines[plan.decode_engine]
        if plan.source is Source.POOL:
            self.pool_free_at = self._serve(self.pool_free_at, now, costs.kv_s(tokens, self.p.pool_link))
            self.pool_queue.append((self.pool_free_at, tokens))
            return self.pool_free_at
        if plan.source in (Source.STORAGE, Source.STORAGE_DE):
            node = pe.node if plan.source is Source.STORAGE else de.node
            end = self._serve(self.storage_free_at[node], now, costs.kv_s(tokens, self.p.storage_link))
            self.storage_free_at[node] = end
            self.storage_queue[node].append((end, tokens))
            return end if plan.source is Source.STORAGE else self._send(de, end, tokens)
        if plan.source is Source.HBM and pe is not de:
            return self._send(de, now, tokens)
        return now

    def _send(self, sender: Engine, now: float, tokens: int) -> float:
        sender.link_free_at = self._serve(
            sender.link_free_at, now, self.p.costs.kv_s(tokens, self.p.data_link)
        )
        return sender.link_free_at

    def execute(
        self, plan: Plan, req: AutoRequest, now: float, prefix_key: str = "", prefix_tokens: int = 0
    ) -> Started:
        """Run `plan`; `prefix_tokens` of the prompt (`prefix_key`) are in the tiers from its first token."""
        pe, de = self.engines[plan.prefill_engine], self.engines[plan.decode_engine]
        ready = self._ready(plan, req, now)
        hit = 0 if plan.source is Source.ROUTE else plan.hit_tokens
        miss = req.prompt_tokens - plan.hit_tokens
        start = max(pe.free_at, ready)
        wait = self._holder_wait(plan, start)
        route = route_costs_s(self.p, plan.hit_tokens, miss, req.output_tokens, wait)
        first_route, later_route = route if plan.source is Source.ROUTE and route else (0.0, 0.0)
        pe.free_at = self._prefill(pe, start, hit, max(1, miss), first_route)
        pe.queued.append((pe.free_at, miss))
        first = pe.free_at if pe is de else self._send(pe, pe.free_at, req.prompt_tokens - _kept(plan))
        batch = sum(1 for d in de.decodes.values() if d[0] > first)
        context = sum(int(d[1]) for d in de.decodes.values() if d[0] > first)
        step = self.p.costs.decode_step_s(batch + 1, context + req.prompt_tokens, de.role)
        end = first + self._t(step * req.output_tokens) + later_route
        per_token = (end - first) / req.output_tokens
        de.decodes[req.request_id] = [end, float(req.prompt_tokens + req.output_tokens), per_token]
        if prefix_tokens > 0:
            self.prefilled.append((first, prefix_key, de.engine_id, min(prefix_tokens, req.prompt_tokens)))
        return Started(first, de.engine_id)

    def _holder_wait(self, plan: Plan, start: float) -> float:
        """A routed exchange waits for the step its holder is running (one step at a time, as the engine)."""
        holder = self.engines.get(plan.source_at) if plan.source is Source.ROUTE else None
        if holder is None:
            return 0.0
        budget, costs = self.shape.max_num_batched_tokens, self.p.costs
        step = costs.prefill_s(0, budget, holder.role)
        step += costs.decode_step_s(len(holder.decodes), 0, holder.role)
        return holder_wait_s(self.p, holder.free_at - start, step)

    def _prefill(self, e: Engine, start: float, hit: int, miss: int, extra_s: float) -> float:
        """Prefill `miss` tokens over `hit` on `e` from `start` in chunks of its budget, each step next to the
        decodes still running then (`extra_s`, a routed exchange, ends the last step); when it ends. A running
        decode with r tokens left shares min(r, steps) steps with it and is delayed by their chunks."""
        budget, costs, noise = self.shape.max_num_batched_tokens, self.p.costs, self._t(1.0)
        chunk_s = [
            noise * costs.prefill_s(hit + done, min(budget, miss - done), e.role)
            for done in range(0, miss, budget)
        ]
        running = [d for d in e.decodes.values() if d[0] > start]
        left = [max(1, int(np.ceil((d[0] - start) / d[2] - 1e-9))) for d in running]
        step_s = []
        for k in range(len(chunk_s)):
            batch = [d for d, r in zip(running, left, strict=True) if r > k]
            step_s.append(noise * costs.decode_step_s(len(batch), sum(d[1] for d in batch), e.role))
        waited = np.concatenate(([0.0], np.cumsum(chunk_s)))
        for d, r in zip(running, left, strict=True):
            d[0] += waited[min(r, len(chunk_s))] + (extra_s if r >= len(chunk_s) else 0.0)
        return start + sum(chunk_s) + sum(step_s) + extra_s

    def decode_end(self, rid: str, engine_id: str) -> float:
        return self.engines[engine_id].decodes[rid][0]

    def finish(self, rid: str, engine_id: str, key: str, stored: int) -> None:
        """The turn is done: its KV is in storage, the pool and the decoding engine's HBM."""
        del self.engines[engine_id].decodes[rid]
        self._commit(engine_id, key, stored)

    def _commit(self, engine_id: str, key: str, tokens: int) -> None:
        """`tokens` of `key` are in storage, the pool and `engine_id`'s HBM (a tier keeps the longest)."""
        e = self.engines[engine_id]
        self.storage[key] = max(self.storage.get(key, 0), tokens)
        _lru_put(self.pool, key, max(tokens, self.pool.get(key, 0)), self.shape.pool_tokens)
        _lru_put(e.resident, key, max(tokens, e.resident.get(key, 0)), self.shape.hbm_tokens)


def _kept(plan: Plan) -> int:
    return plan.hit_tokens if plan.source is Source.HBM else 0


def _lru_put(tier: OrderedDict[str, int], key: str, tokens: int, capacity: int) -> None:
    tier.pop(key, None)
    tier[key] = tokens
    while sum(tier.values()) > capacity and len(tier) > 1:
        tier.popitem(last=False)


def _pending(queue: list[tuple[float, int]], now: float) -> int:
    queue[:] = [q for q in queue if q[0] > now]
    return sum(t for _, t in queue)


def _load(e: Engine, now: float, budget_tokens: int) -> EngineLoad:
    """What the engine's load report says: its queue in tokens and in seconds (an engine knows when its queued
    prefills end), its running decodes, its link's backlog, its prefill token budget."""
    running = [d for d in e.decodes.values() if d[0] > now]
    return EngineLoad(
        e.engine_id,
        e.role,
        e.node,
        _pending(e.queued, now),
        max(0.0, e.free_at - now),
        len(running),
        int(sum(d[1] for d in running)),
        max(0.0, e.link_free_at - now),
        max_num_batched_tokens=budget_tokens,
    )


def _engines(shape: ClusterShape) -> dict[str, Engine]:
    out: dict[str, Engine] = {}
    for node in range(shape.nodes):
        for i in range(shape.engines_per_node):
            if shape.topology == PD:
                role = ROLE_PREFILL if i % 2 == 0 else ROLE_DECODE
                name = f"{'pe' if role == ROLE_PREFILL else 'de'}{node}-{i // 2}"
            else:
                role, name = ROLE_COLOCATED, f"e{node}-{i}"
            out[name] = Engine(name, role, node)
    return out

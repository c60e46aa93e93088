"""Replay a workload's sessions on a simulated cluster under one policy; score and compare policies.

Scores are lower-is-better, as `kvpath bench auto --json` reports them: the mean session JCT (first arrival
to last token) in seconds, and for the `ampd` workload 1 - SLO attainment (a session meets its SLO when every
turn's TTFT and its mean ITL are under the thresholds). Every request's predicted TTFT (the estimator's price
of the plan its policy chose, on the snapshot it saw) is kept next to the simulated one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from loadgen.sim.auto.cluster import ClusterShape, SimCluster
from loadgen.sim.auto.policies import POLICIES
from loadgen.sim.auto.workloads import HOLDER_KEY, WORKLOADS, Scale, Session, build
from services.policy.ampd_costs import CostModel, Link, Piecewise
from services.policy.auto import Decision, plan
from services.policy.auto_costs import AutoProfiles
from services.policy.movequery_profile import paper_profile


def gpu_profiles(itl_weight: float = 1.0) -> AutoProfiles:
    """H100-class constants for the paper-scale runs: 25k tokens/s prefill with an attention term, ~20 ms
    decode steps, 100 KB of KV per token, a 2 GB/s storage NIC per node, a 20 GB/s pool, 25 GB/s RDMA."""
    pre = Piecewise((0.0,), ((0.015, 4e-5, 2e-9),))
    dec = Piecewise((0.0,), ((0.012, 2e-4, 5e-9),))
    links = {"storage": Link(1e-3, 2e9), "pool": Link(5e-5, 2e10), "rdma": Link(2e-5, 2.5e10)}
    kinds = ("prefill", "decode", "colocated")
    costs = CostModel(100_000, dict.fromkeys(kinds, pre), dict.fromkeys(kinds, dec), links)
    return AutoProfiles(
        costs,
        data_link="rdma",
        route=paper_profile(with_compute=True),
        route_fabric="ibgda",
        itl_weight=itl_weight,
    )


@dataclass(slots=True)
class RunResult:
    policy: str
    workload: str
    jct_s: list[float] = field(default_factory=list)
    meets_slo: list[bool] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    predicted_s: list[float] = field(default_factory=list)
    plans: dict[str, int] = field(default_factory=dict)

    def score(self) -> float:
        if self.workload == "ampd":
            return 1.0 - float(np.mean(self.meets_slo)) if self.meets_slo else 1.0
        return float(np.mean(self.jct_s)) if self.jct_s else 0.0

    def mdape(self) -> float:
        err = [abs(p - m) / m for p, m in zip(self.predicted_s, self.ttft_s, strict=True) if m > 0]
        return float(np.median(err)) if err else 0.0


@dataclass(slots=True)
class _Live:
    session: Session
    turn: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)


def simulate(
    sessions: list[Session],
    policy: str,
    shape: ClusterShape,
    profiles: AutoProfiles,
    seed: int,
    workload: str = "",
    explained: list[tuple[Decision, float]] | None = None,
) -> RunResult:
    """Run `sessions` under `policy`; `explained` (when given) collects auto's full decisions (chosen plan and
    runner-up, recomputed on the same snapshot) with each request's simulated TTFT."""
    return _Replay(sessions, policy, shape, profiles, seed, workload, explained).run()


class _Replay:
    def __init__(
        self,
        sessions: list[Session],
        policy: str,
        shape: ClusterShape,
        profiles: AutoProfiles,
        seed: int,
        workload: str,
        explained: list[tuple[Decision, float]] | None,
    ) -> None:
        self.rule, topology = POLICIES[policy]
        self.cluster = SimCluster(replace(shape, topology=topology), profiles, seed, HOLDER_KEY)
        held = [t.stored_after for s in sessions for t in s.turns if t.prefix_key == HOLDER_KEY]
        if held:
            self.cluster.pin(HOLDER_KEY, max(held))
        self.profiles, self.explained = profiles, explained
        self.result = RunResult(policy, workload)
        self.live = [_Live(s) for s in sessions]
        self.events = [(s.start_s, i, "arrive", i, "") for i, s in enumerate(sessions)]
        heapq.heapify(self.events)
        self.seq = len(self.events)

    def _push(self, at: float, kind: str, i: int, engine: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, i, engine))

    def run(self) -> RunResult:
        while self.events:
            now, _, kind, i, engine = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(now, i)
            else:
                self._finish(now, i, engine)
        return self.result

    def _arrive(self, now: float, i: int) -> None:
        state, cluster = self.live[i], self.cluster
        turn, rid = state.session.turns[state.turn], f"{state.session.session_id}-{state.turn}"
        cluster.advance(now)
        req = cluster.request(
            rid, turn.prefix_key, turn.prompt_tokens, turn.output_tokens, state.session.ttft_slo_s
        )
        snapshot = cluster.snapshot(now)
        chosen = self.rule(req, snapshot, self.profiles)
        prefix = min(turn.prompt_tokens, turn.stored_after)
        started = cluster.execute(chosen, req, now, turn.prefix_key, prefix)
        ttft = started.first_token_s - now
        self.result.plans[chosen.label] = self.result.plans.get(chosen.label, 0) + 1
        self.result.predicted_s.append(chosen.ttft_s)
        self.result.ttft_s.append(ttft)
        if self.explained is not None:
            decision = plan(req, snapshot, self.profiles)
            if decision is not None:
                self.explained.append((decision, ttft))
        state.ttfts.append(ttft)
        end = cluster.decode_end(rid, started.decode_engine)
        state.itls.append((end - started.first_token_s) / turn.output_tokens)
        self._push(end, "finish", i, started.decode_engine)

    def _finish(self, now: float, i: int, engine: str) -> None:
        state = self.live[i]
        turn, rid = state.session.turns[state.turn], f"{state.session.session_id}-{state.turn}"
        end = self.cluster.decode_end(rid, engine)
        if end > now + 1e-12:  # a later prefill on its engine paused it: not done yet
            self._push(end, "finish", i, engine)
            return
        self.cluster.finish(rid, engine, turn.prefix_key, turn.stored_after)
        state.turn += 1
        if state.turn < len(state.session.turns):
            self._push(now + turn.tool_s, "arrive", i, "")
        else:
            _close(self.result, state, now)


def _close(result: RunResult, state: _Live, now: float) -> None:
    s = state.session
    result.jct_s.append(now - s.start_s)
    ttft_ok = s.ttft_slo_s is None or max(state.ttfts) <= s.ttft_slo_s
    itl_ok = s.itl_slo_s is None or float(np.mean(state.itls)) <= s.itl_slo_s
    result.meets_slo.append(ttft_ok and itl_ok)


def compare(
    scale: Scale,
    shape: ClusterShape,
    profiles: AutoProfiles,
    seed: int = 0,
    workloads: tuple[str, ...] = WORKLOADS,
    policies: tuple[str, ...] = tuple(POLICIES),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every policy on every workload: scores, auto's TTFT prediction error, the plans each chose."""
    results: dict[str, dict[str, float]] = {}
    plans: dict[str, dict[str, dict[str, int]]] = {}
    mdape: dict[str, float] = {}
    for workload in workloads:
        sessions = build(workload, scale, seed)
        results[workload], plans[workload] = {}, {}
        for policy in policies:
            run = simulate(sessions, policy, shape, profiles, seed, workload)
            results[workload][policy] = run.score()
            plans[workload][policy] = dict(sorted(run.plans.items()))
            if policy == "auto":
                mdape[workload] = run.mdape()
            if progress:
                progress(f"{workload:9s} {policy:12s} {run.score():9.3f}")
    return {
        "results": results,
        "plans": plans,
        "ttft_mdape_by_workload": mdape,
        "ttft_mdape": float(np.median(list(mdape.values()))) if mdape else 0.0,
    }

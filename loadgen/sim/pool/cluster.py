"""The paper's cluster on a simulated clock: servers x GPUs colocated vLLM instances behind one router, fed by
closed-loop clients, one system (`config.SystemSpec`) at a time.

The router builds one `EngineSnapshot` (role colocated) per instance from its queues, as the live router does
from load reports, and calls the house's policies: Beluga routes cache-obliviously with `pick_least_loaded`,
the baseline cache-aware with `pick_cache_aware`, credited with the prompt tokens each instance's own tiers
hold (its HBM, its server's DRAM tier). A run replays the whole trace: every client sends its next request
as soon as its last one ends (no think time, I), the paper's closed loop at peak throughput. A cluster keeps
its tiers between runs, so the second run of the same trace is the paper's cache-hit run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loadgen.metrics import distribution
from loadgen.sim.events import EventLoop
from loadgen.sim.pool.backends import make_backend
from loadgen.sim.pool.config import PoolSetup, SystemSpec
from loadgen.sim.pool.instance import Instance, Seq
from loadgen.sim.pool.tiers import PrefixTier
from loadgen.sim.pool.workload import LvRequest
from services.policy.colocated import pick_cache_aware, pick_least_loaded
from services.policy.snapshot import ROLE_COLOCATED, EngineSnapshot
from shared.errors import KvpathError


@dataclass(slots=True)
class RunState:
    trace: tuple[LvRequest, ...]
    started_s: float
    next_index: int = 0
    last_sent_s: float = 0.0


class PoolCluster:
    def __init__(self, setup: PoolSetup, system: SystemSpec) -> None:
        self.setup = setup
        self.system = system
        self.loop = EventLoop()
        self.backend = make_backend(self.loop, setup, system)
        cfg = setup.config
        self.instances = [
            Instance(
                self.loop,
                server,
                slot,
                PrefixTier(f"hbm-{server}.{slot}", setup.hbm_blocks, setup.cxl.block_tokens),
                self.backend,
                setup.step,
                cfg.step_tokens,
            )
            for server in range(cfg.servers)
            for slot in range(cfg.gpus_per_server)
        ]
        self._by_id = {e.engine_id: e for e in self.instances}
        self.num_routed = 0

    def route(self, request: LvRequest) -> Instance:
        """The router's decision for one request, by the live policy functions."""
        engines = [
            EngineSnapshot(
                engine_id=e.engine_id,
                role=ROLE_COLOCATED,
                node=e.server,
                group=f"node{e.server}",
                num_unfinished=e.num_unfinished,
                unfinished_tokens=e.unfinished_tokens,
            )
            for e in self.instances
        ]
        if self.system.is_cache_aware:
            hits = {e.engine_id: e.local_hit_tokens(request) for e in self.instances}
            chosen = pick_cache_aware(engines, hits, request.prompt_tokens)
        else:
            chosen = pick_least_loaded(engines)
        if chosen is None:
            raise KvpathError("no instance takes work")
        self.num_routed += 1
        return self._by_id[chosen]

    def run(self, trace: tuple[LvRequest, ...], name: str) -> dict[str, Any]:
        """Replay `trace` with the configured closed-loop clients; the summary of this run."""
        state = RunState(trace, started_s=self.loop.now, last_sent_s=self.loop.now)
        done: list[Seq] = []

        def send() -> None:
            if state.next_index >= len(trace):
                return
            request = trace[state.next_index]
            state.next_index += 1
            state.last_sent_s = self.loop.now
            self.route(request).submit(Seq(request, self.loop.now, finished))

        def finished(seq: Seq) -> None:
            done.append(seq)
            send()

        for _ in range(min(self.setup.config.clients, len(trace))):
            send()
        self.loop.run()
        if len(done) != len(trace):
            raise KvpathError(f"{name}: {len(trace) - len(done)} requests never finished")
        return summarize(name, self.system, done, state)


def summarize(name: str, system: SystemSpec, done: list[Seq], state: RunState) -> dict[str, Any]:
    """Table 5's metrics of one run: TTFT and TPOT (loadgen's definitions), QPS (completions per second while
    every client was still busy: the closed loop's peak), and where the prompt tokens came from."""
    ttft = [s.first_token_s - s.sent_s for s in done]
    tpot = [(s.finish_s - s.first_token_s) / (s.output_tokens - 1) for s in done if s.output_tokens > 1]
    window_s = state.last_sent_s - state.started_s
    in_window = sum(1 for s in done if s.finish_s <= state.last_sent_s)
    makespan_s = max(s.finish_s for s in done) - state.started_s
    prompt = sum(s.request.prompt_tokens for s in done)
    hbm = sum(s.hbm_hit_tokens for s in done)
    loaded = sum(s.loaded_tokens for s in done)
    return {
        "system": system.name,
        "run": name,
        "requests": len(done),
        "ttft_s": distribution(ttft),
        "tpot_s": distribution(tpot),
        "qps": in_window / window_s if window_s > 0 else len(done) / makespan_s,
        "qps_makespan": len(done) / makespan_s,
        "makespan_s": makespan_s,
        "hit_ratio": (hbm + loaded) / prompt,
        "hbm_hit_ratio": hbm / prompt,
        "load_s": distribution([s.load_s for s in done if s.loaded_tokens]),
        "prompt_tokens_mean": prompt / len(done),
    }

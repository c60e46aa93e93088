"""A request's life on the simulated cluster, from the agent's turn to the next turn.

arrival -> FIFO -> placed (PE, DE, read side) -> allocated (DE buffer for the whole prompt KV on the DE's
node, PE buffer for the hit KV on the PE's node under the PE path) -> hit KV read on the read side's
storage NIC -> the PE batches it (layerwise or not) -> first token -> last layer's KV reaches the DE buffer
-> H2D into DE HBM (DE buffer freed) -> decode -> new full blocks persisted over the DE node's storage NIC
-> the agent's next turn after its tool pause (none in DualPath's replay).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

from loadgen.sim.cluster import ClusterBase
from loadgen.sim.requests import SimRequest
from loadgen.sim.scheduler import SchedulerCost
from loadgen.sim.traffic import TrafficCounters
from loadgen.sim.workload import hit_tokens
from services.policy.snapshot import PendingRequest, Placement, ReadSide
from shared.blocks import max_hit_blocks
from shared.errors import KvpathError


@dataclass(slots=True)
class RawRun:
    """Everything a run produced, before summarizing (`loadgen/sim/results.py`)."""

    records: list[tuple[float, ...]]
    agent_arrival_s: list[float]
    agent_finish_s: list[float]  # NaN for agents that did not finish
    storage_samples: list[tuple[float, int, float]]  # (t, node, cumulative SNIC read bytes)
    snic_read_bytes: list[float]
    snic_write_bytes: list[float]
    traffic: TrafficCounters
    scheduler: SchedulerCost
    attention_balance: list[tuple[float, float]]
    end_s: float
    num_events: int
    wall_s: float
    num_waiting: int  # requests still in the scheduler FIFO at the end
    oldest_waiting_s: float  # how long the FIFO's head had waited by then


class ClusterSim(ClusterBase):
    def run(self) -> RawRun:
        config = self.setup.config
        started = time.perf_counter()
        plans = self.workload.plans
        self.turn = [0] * len(plans)
        self.context = [0] * len(plans)
        self.agent_finish_s = [math.nan] * len(plans)
        self.num_agents_left = len(plans)
        self.records: list[tuple[float, ...]] = []
        self.samples: list[tuple[float, int, float]] = []
        self.alloc_wait: list[SimRequest] = []
        for agent, arrival in enumerate(self.workload.arrivals_s):
            self.loop.at(arrival, self._issue_turn, agent)
        self.loop.at(0.0, self._sample)
        until = config.duration_s if config.mode == "online" else math.inf
        if config.max_sim_s:
            until = min(until, config.max_sim_s)
        self.loop.run(until_s=until)
        self._sample_now()
        return RawRun(
            records=self.records,
            agent_arrival_s=list(self.workload.arrivals_s),
            agent_finish_s=self.agent_finish_s,
            storage_samples=self.samples,
            snic_read_bytes=[n.snic_read.bytes_moved() for n in self.nodes],
            snic_write_bytes=[n.snic_write.bytes_moved() for n in self.nodes],
            traffic=self.traffic,
            scheduler=self.scheduler.cost,
            attention_balance=self.attention_balance,
            end_s=self.loop.now,
            num_events=self.loop.num_events,
            wall_s=time.perf_counter() - started,
            num_waiting=len(self.scheduler.fifo),
            oldest_waiting_s=self.loop.now - self.scheduler.fifo[0].arrival_s if self.scheduler.fifo else 0.0,
        )

    # --------------------------------------------------------------------------------------- sampling

    def _sample_now(self) -> None:
        now = self.loop.now
        self.samples.extend((now, n.node, n.snic_read.bytes_moved()) for n in self.nodes)

    def _sample(self) -> None:
        self._sample_now()
        if self.num_agents_left == 0:
            return
        if self.loop.is_idle:
            raise KvpathError(
                f"simulation stalled at t={self.loop.now:.3f} s: {len(self.scheduler.fifo)} requests wait "
                f"for a placement, {len(self.alloc_wait)} for a DRAM buffer, and nothing else is in flight"
            )
        self.loop.after(self.setup.config.balance_window_s, self._sample)

    # -------------------------------------------------------------------------------------- lifecycle

    def _issue_turn(self, agent: int) -> None:
        turn, context = self.turn[agent], self.context[agent]
        plan = self.workload.plans[agent]
        prompt = context + plan.appends[turn]
        block = self.setup.config.block_size
        hit = min(hit_tokens(context, block), max_hit_blocks(prompt, block) * block)
        gen = plan.gens[turn]
        pending = PendingRequest(f"{agent}:{turn}", prompt, hit, prompt + gen)
        request = SimRequest(agent, turn, prompt, hit, gen, pending, arrival_s=self.loop.now)
        self.scheduler.enqueue(request)

    def _on_placed(self, request: SimRequest, placement: Placement) -> None:
        request.placed_s = self.loop.now
        pe, de = self.pe_by_id[placement.pe_id], self.de_by_id[placement.de_id]
        request.pe_index, request.pe_node = pe.index, pe.node
        request.de_index, request.de_node = de.index, de.node
        request.read_side = placement.read_side
        request.read_node = -1 if placement.read_node is None else placement.read_node
        request.read_tokens = placement.read_tokens if placement.read_side is not None else 0
        pe.assign(request)
        de.assign(request)
        self.loads_changed(pe, de)
        if request.read_node >= 0:
            self.nodes[request.read_node].read_queue_tokens += request.read_tokens
            self.loads_changed(node=self.nodes[request.read_node])
        request.de_buffer_bytes = request.prompt_tokens * self.kv_bytes_per_token
        if request.read_side is ReadSide.PE:
            request.pe_buffer_bytes = request.read_tokens * self.kv_bytes_per_token
        self.alloc_wait.append(request)
        self._allocate()

    def _allocate(self) -> None:
        """Give DRAM buffers to waiting requests, first fit in placement order."""
        still: list[SimRequest] = []
        for request in self.alloc_wait:
            pe_node, de_node = self.nodes[request.pe_node], self.nodes[request.de_node]
            if de_node.can_hold(request.de_buffer_bytes) and pe_node.can_hold(request.pe_buffer_bytes):
                de_node.buffer_used_bytes += request.de_buffer_bytes
                pe_node.buffer_used_bytes += request.pe_buffer_bytes
                request.allocated_s = self.loop.now
                self._start_read(request)
            else:
                still.append(request)
        self.alloc_wait = still

    def _free_buffer(self, node: int, num_bytes: float) -> None:
        if num_bytes > 0:
            self.nodes[node].buffer_used_bytes = max(0.0, self.nodes[node].buffer_used_bytes - num_bytes)
            if self.alloc_wait:
                self._allocate()

    def _start_read(self, request: SimRequest) -> None:
        if request.read_tokens <= 0:
            self._on_read_done(request)
            return
        self.traffic.read_into_buffer(request)
        link = self.nodes[request.read_node].snic_read
        link.start(request.read_tokens * self.kv_bytes_per_token, partial(self._on_read_done, request))

    def _on_read_done(self, request: SimRequest) -> None:
        request.read_done_s = self.loop.now
        if request.read_node >= 0:
            self.nodes[request.read_node].read_queue_tokens -= request.read_tokens
            self.loads_changed(node=self.nodes[request.read_node])
            self.scheduler.request_round()
        pe = self.pes[request.pe_index]
        pe.add_work(request)
        self.group_of[pe.engine_id].kick()

    def _on_prefilled(self, request: SimRequest) -> None:
        request.first_token_s = self.loop.now
        self.pes[request.pe_index].release(request)
        self.loads_changed(self.pes[request.pe_index])
        self.traffic.prefill(request)
        self._free_buffer(request.pe_node, request.pe_buffer_bytes)
        self.scheduler.request_round()
        if request.gen_tokens <= 1:
            request.finish_s = self.loop.now
            self._finish_turn(request)
        # the last layer's KV (all of it on the PE path, the miss part on the DE path) reaches the DE buffer
        sent = request.prompt_tokens - (request.read_tokens if request.read_side is ReadSide.DE else 0)
        tail_s = sent * self.setup.model.kv_bytes_per_layer_token / self.setup.net_bytes_per_s
        self.loop.after(tail_s, self._start_h2d, request)

    def _start_h2d(self, request: SimRequest) -> None:
        self.des[request.de_index].h2d.start(request.de_buffer_bytes, partial(self._on_h2d_done, request))

    def _on_h2d_done(self, request: SimRequest) -> None:
        self.traffic.decode_h2d(request)
        self._free_buffer(request.de_node, request.de_buffer_bytes)
        if request.gen_tokens > 1:
            self.des[request.de_index].join(request)
        else:
            self._release_decode(request)

    def _on_decoded(self, request: SimRequest) -> None:
        self._release_decode(request)
        self._finish_turn(request)

    def _release_decode(self, request: SimRequest) -> None:
        """The DE is done with the request: free its HBM and persist the blocks that filled."""
        self.des[request.de_index].release(request)
        self.loads_changed(self.des[request.de_index])
        block = self.setup.config.block_size
        num_blocks = (request.prompt_tokens + request.gen_tokens) // block - request.hit_tokens // block
        num_bytes = num_blocks * block * self.kv_bytes_per_token
        if num_bytes > 0:
            self.traffic.persist(request, num_bytes)
            self.nodes[request.de_node].snic_write.start(num_bytes, _nothing)
        self.scheduler.request_round()

    def _finish_turn(self, request: SimRequest) -> None:
        self.records.append(request.record())
        agent = request.agent
        plan = self.workload.plans[agent]
        turn = self.turn[agent]
        self.context[agent] += plan.appends[turn] + plan.gens[turn]
        self.turn[agent] = turn + 1
        if turn + 1 < plan.num_turns:
            self.loop.after(plan.tool_s[turn], self._issue_turn, agent)
            return
        self.agent_finish_s[agent] = self.loop.now
        self.num_agents_left -= 1
        if self.num_agents_left == 0 and self.setup.config.mode == "offline":
            self.loop.stop()


def _nothing() -> None:
    return None

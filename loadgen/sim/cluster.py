"""The simulated cluster: nodes (storage NIC links, DRAM buffer), PEs in step groups, DEs, and the global
scheduler wired to them; `ClusterSim.run()` plays a workload through it (see `loadgen/sim/lifecycle.py`).

Node ids: prefill nodes 0..P-1, decode nodes P..P+D-1. Engine ids `pe<node>.<gpu>` / `de<node>.<gpu>`, grouped
per node (`node<n>`) as the live router groups them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loadgen.profiles import PROFILES
from loadgen.sim.config import SimSetup
from loadgen.sim.decode import DecodeEngine
from loadgen.sim.events import EventLoop
from loadgen.sim.fluid import FluidLink
from loadgen.sim.models import SimModel
from loadgen.sim.pipeline import StepTiming
from loadgen.sim.prefill import PrefillEngine, PrefillGroup, profile_attention
from loadgen.sim.requests import SimRequest
from loadgen.sim.scheduler import GlobalScheduler
from loadgen.sim.traffic import TrafficCounters
from loadgen.sim.workload import Workload
from services.policy.load_table import LoadTable
from services.policy.short_first import PrefillQueue
from services.policy.snapshot import ROLE_DECODE, ROLE_PREFILL, EngineSnapshot, NodeSnapshot, Placement
from services.policy.thresholds import Thresholds, thresholds_from_rates
from shared.errors import ConfigError


@dataclass(slots=True)
class Node:
    node: int
    role: str
    snic_read: FluidLink
    snic_write: FluidLink
    buffer_capacity_bytes: float
    buffer_used_bytes: float = 0.0
    read_queue_tokens: int = 0

    def can_hold(self, num_bytes: float) -> bool:
        # an empty buffer takes anything, so one oversized request cannot block a node forever
        return (
            num_bytes <= 0
            or self.buffer_used_bytes == 0
            or self.buffer_used_bytes + num_bytes <= self.buffer_capacity_bytes
        )


def nominal_prefill_tokens_per_s(
    model: SimModel, context_tokens: int, append_tokens: int, count_prompt: bool
) -> float:
    """A PE's rate on a typical turn, alone on its GPU: what beta uses before any step is measured."""
    layer_s = (
        model.attention_layer_flops(context_tokens, append_tokens) / model.attention_flops_per_s
        + model.linear_layer_flops(append_tokens) / model.linear_flops_per_s
    )
    tokens = context_tokens + append_tokens if count_prompt else append_tokens
    return tokens / (layer_s * model.num_layers)


class ClusterBase:
    """Construction, load snapshots and thresholds; the request lifecycle is in `ClusterSim`."""

    def __init__(self, setup: SimSetup, workload: Workload) -> None:
        self.setup = setup
        self.workload = workload
        self.loop = EventLoop()
        self.kv_bytes_per_token = float(setup.model.kv_bytes_per_token)
        self.nodes = [self._node(n) for n in range(setup.num_nodes)]
        self._build_prefill()
        self._build_decode()
        self._check_fits(workload)
        self.traffic = TrafficCounters(self.kv_bytes_per_token)
        engines, nodes = self.snapshot_parts()
        self._table = LoadTable.of(engines, nodes)
        # engines and nodes whose loads changed since the last round (the table is updated from them)
        self._changed_engines: dict[str, PrefillEngine | DecodeEngine] = {}
        self._changed_nodes: dict[int, Node] = {}
        self._thresholds: Thresholds | None = None
        self.scheduler = GlobalScheduler(
            self.loop,
            setup.config.policy,
            setup.config.fetch_period_s,
            self.load_table,
            self.thresholds,
            self._on_placed,
            prefill_queue=self._prefill_queue if setup.config.prefill_order == "short-first" else None,
        )
        # each node's storage service reports its configured bandwidth, as the live one does
        self.read_rates = [setup.snic_bytes_per_s / self.kv_bytes_per_token] * len(self.nodes)
        self.fallback_prefill_tokens_per_s = self._fallback_rate()
        self.attention_balance: list[tuple[float, float]] = []  # (time, max/avg) per multi-rank step

    def _prefill_queue(self, pe_id: str) -> PrefillQueue | None:
        """A PE's queue as a short-first PE's load report lists it (the router's past-beta placement)."""
        return self.pe_by_id[pe_id].prefill_queue(self.setup.config.beta_s)

    def _build_prefill(self) -> None:
        setup, g = self.setup, self.setup.gpus_per_node
        profile = profile_attention(setup.model)
        self.pes = [
            PrefillEngine(f"pe{n}.{i}", n, n * g + i, setup, profile)
            for n in range(setup.num_prefill_nodes)
            for i in range(g)
        ]
        self.groups: list[PrefillGroup] = []
        self.group_of: dict[str, PrefillGroup] = {}
        for n in range(setup.num_prefill_nodes):
            members = self.pes[n * g : (n + 1) * g]
            for part in [members] if setup.model.is_expert_parallel else [[e] for e in members]:
                group = PrefillGroup(self.loop, part, setup, self._on_prefilled, self._on_step)
                self.groups.append(group)
                self.group_of.update({e.engine_id: group for e in part})
        self.pe_by_id = {e.engine_id: e for e in self.pes}

    def _build_decode(self) -> None:
        setup, g, model = self.setup, self.setup.gpus_per_node, self.setup.model
        self.de_capacity_tokens = int(model.de_kv_bytes // model.kv_bytes_per_token)
        tpot_s = setup.config.tpot_s
        step_model = (lambda n, c: tpot_s) if tpot_s > 0 else model.decode.step_s
        self.des: list[DecodeEngine] = []
        for k in range(setup.num_decode_nodes * g):
            node = setup.num_prefill_nodes + k // g
            h2d = FluidLink(self.loop, setup.kv_copy_bytes_per_s, name=f"h2d{k}")
            self.des.append(
                DecodeEngine(
                    self.loop,
                    f"de{node}.{k % g}",
                    node,
                    k,
                    self.de_capacity_tokens,
                    h2d,
                    step_model,
                    self._on_decoded,
                )
            )
        self.de_by_id = {e.engine_id: e for e in self.des}

    def _check_fits(self, workload: Workload) -> None:
        """A request no DE can hold would wait forever: refuse the run instead."""
        need, capacity, model = (
            max(p.total_tokens for p in workload.plans),
            self.de_capacity_tokens,
            self.setup.model,
        )
        if need > capacity:
            raise ConfigError(
                f"a trajectory needs {need} tokens of DE HBM but a DE holds {capacity} "
                f"({model.de_kv_bytes / 1e9:g} GB at {model.kv_bytes_per_token} B/token): raise --de-kv-gb"
            )

    def _node(self, n: int) -> Node:
        setup = self.setup
        role = ROLE_PREFILL if n < setup.num_prefill_nodes else ROLE_DECODE
        reads = FluidLink(
            self.loop,
            setup.snic_bytes_per_s,
            max_active=setup.config.max_concurrent_reads,
            name=f"snic{n}.read",
        )
        writes = FluidLink(self.loop, setup.snic_bytes_per_s, name=f"snic{n}.write")
        return Node(n, role, reads, writes, setup.model.dram_buffer_bytes)

    def _fallback_rate(self) -> float:
        targets = PROFILES[self.setup.profile_name].dualpath
        context, append = (int(targets.context), int(targets.append)) if targets else (16384, 512)
        is_prompt = self.setup.config.beta_rate == "prompt"
        return nominal_prefill_tokens_per_s(self.setup.model, context, append, is_prompt)

    # ------------------------------------------------------------------------------------ scheduler inputs

    def snapshot_parts(self) -> tuple[tuple[EngineSnapshot, ...], tuple[NodeSnapshot, ...]]:
        """What load reports would say now (with the router's notes: loads change at placement), built from
        scratch as the live router builds it every round."""
        engines = [self._engine_snapshot(e) for e in self.pes] + [self._engine_snapshot(d) for d in self.des]
        nodes = tuple(NodeSnapshot(n.node, n.read_queue_tokens) for n in self.nodes)
        return tuple(engines), nodes

    def _engine_snapshot(self, e: PrefillEngine | DecodeEngine) -> EngineSnapshot:
        if isinstance(e, DecodeEngine):
            loads = (e.num_unfinished, e.unfinished_tokens, e.free_kv_tokens)
            return EngineSnapshot(e.engine_id, ROLE_DECODE, e.node, f"node{e.node}", *loads)
        return EngineSnapshot(
            e.engine_id, ROLE_PREFILL, e.node, f"node{e.node}", e.num_unfinished, e.unfinished_tokens
        )

    def loads_changed(self, *engines: PrefillEngine | DecodeEngine, node: Node | None = None) -> None:
        """Note engines (and a node) whose loads changed: the next round's table updates only those."""
        for e in engines:
            self._changed_engines[e.engine_id] = e
        if node is not None:
            self._changed_nodes[node.node] = node

    def load_table(self) -> LoadTable:
        """The table the scheduler reads: what `snapshot_parts` says, updated in place for what changed."""
        table = self._table
        for n in self._changed_nodes.values():
            table.update_node(NodeSnapshot(n.node, n.read_queue_tokens))
        for e in self._changed_engines.values():  # role, node and group never change in the simulator
            free_kv_tokens = e.free_kv_tokens if isinstance(e, DecodeEngine) else 0
            table.update_loads(e.engine_id, e.num_unfinished, e.unfinished_tokens, free_kv_tokens)
        self._changed_nodes.clear()
        self._changed_engines.clear()
        return table

    def thresholds(self) -> Thresholds:
        """alpha / beta from the nodes' read rates and the PEs' measured prefill rates (which change only when
        a prefill step ends: `_on_step` drops the cached value)."""
        if self._thresholds is None:
            self._thresholds = self._fresh_thresholds()
        return self._thresholds

    def _fresh_thresholds(self) -> Thresholds:
        config = self.setup.config
        return thresholds_from_rates(
            self.read_rates,
            [e.prefill_rate.value for e in self.pes],
            alpha_s=config.alpha_s,
            beta_s=config.beta_s,
            z_factor=config.z_factor,
            fallback_prefill_tokens_per_s=self.fallback_prefill_tokens_per_s,
        )

    # ------------------------------------------------------------------------- callbacks (ClusterSim)

    def _on_placed(self, request: SimRequest, placement: Placement) -> None:
        raise NotImplementedError

    def _on_prefilled(self, request: SimRequest) -> None:
        raise NotImplementedError

    def _on_decoded(self, request: SimRequest) -> None:
        raise NotImplementedError

    def _on_step(self, timing: StepTiming) -> None:
        self._thresholds = None  # the group's PEs update their prefill rates as this step completes
        ratio = timing.attention_balance
        if ratio is not None and not math.isnan(ratio):
            self.attention_balance.append((self.loop.now, ratio))

"""The shared KV tier behind every instance's HBM, one class per system, as an instance's connector sees it:
how many prompt tokens it can serve, load them, save newly computed ones.

* `CxlBackend` (Beluga): one pool in 16-token blocks that every instance reads at the same cost; nothing is
  local to an instance, so routing needs no credit from it.
* `RdmaBackend` (vLLM + LMCache + MoonCake store): a local DRAM tier per server (LMCache's CPU backend) in
  front of the RDMA pool, both in whole objects of `object_tokens`; what a server's DRAM tier holds is the
  local credit of the cache-aware router. Loaded objects are kept in the local tier too (I).
"""

from __future__ import annotations

from dataclasses import replace

from loadgen.sim.events import EventLoop
from loadgen.sim.pool.config import PoolSetup, SystemSpec
from loadgen.sim.pool.costs import hit_cap_tokens
from loadgen.sim.pool.paths import CxlPath, Done, RdmaPath
from loadgen.sim.pool.tiers import PrefixTier, split_units
from loadgen.sim.pool.workload import LvRequest


class CxlBackend:
    __slots__ = ("path", "pool", "unit_tokens")

    def __init__(self, loop: EventLoop, setup: PoolSetup, system: SystemSpec) -> None:
        cfg, cxl = setup.config, setup.cxl
        self.unit_tokens = cxl.block_tokens
        block_bytes = cxl.block_tokens * setup.geometry.kv_bytes_per_token
        self.pool = PrefixTier("cxl-pool", int(cxl.pool_bytes // block_bytes), cxl.block_tokens)
        self.path = CxlPath(
            loop, cxl, setup.geometry, cfg.servers, cfg.gpus_per_server, is_interleaved=system.is_interleaved
        )

    def external_hit_tokens(self, server: int, request: LvRequest) -> int:
        return min(self.pool.match_tokens(request), hit_cap_tokens(request.prompt_tokens, self.unit_tokens))

    def local_tokens(self, server: int, request: LvRequest) -> int:
        return 0  # one symmetric pool: no instance holds more of it than another

    def load(self, server: int, slot: int, request: LvRequest, start: int, stop: int, on_done: Done) -> None:
        """Tokens [start, stop) of the prompt, both on block boundaries."""
        self.pool.match_units(request, touch=True)
        ranges = split_units(request, self.unit_tokens, start // self.unit_tokens, stop // self.unit_tokens)
        self.path.load(server, slot, ranges, on_done)

    def save(self, server: int, slot: int, request: LvRequest, computed: int, on_done: Done) -> None:
        added = self.pool.store(request, computed)
        if not added:
            on_done()
            return
        self.path.store(server, slot, added, on_done)


class RdmaBackend:
    __slots__ = ("locals", "path", "pool", "unit_tokens")

    def __init__(self, loop: EventLoop, setup: PoolSetup, system: SystemSpec) -> None:
        cfg, rdma = setup.config, setup.rdma
        self.unit_tokens = system.object_tokens
        object_bytes = system.object_tokens * setup.geometry.kv_bytes_per_token
        self.pool = PrefixTier("rdma-pool", int(rdma.pool_bytes // object_bytes), self.unit_tokens)
        local_units = int(rdma.local_dram_bytes // object_bytes)
        self.locals = [PrefixTier(f"dram-{s}", local_units, self.unit_tokens) for s in range(cfg.servers)]
        costs = replace(rdma, object_tokens=system.object_tokens)
        self.path = RdmaPath(loop, costs, setup.geometry, cfg.servers, cfg.gpus_per_server)

    def external_hit_tokens(self, server: int, request: LvRequest) -> int:
        held = max(self.pool.match_tokens(request), self.locals[server].match_tokens(request))
        return min(held, hit_cap_tokens(request.prompt_tokens, self.unit_tokens))

    def local_tokens(self, server: int, request: LvRequest) -> int:
        return self.locals[server].match_tokens(request)

    def load(self, server: int, slot: int, request: LvRequest, start: int, stop: int, on_done: Done) -> None:
        """Whole objects covering tokens [start, stop): the local tier's leading ones, the pool's after."""
        unit = self.unit_tokens
        first, last = start // unit, stop // unit
        local_end = max(first, min(last, self.locals[server].match_units(request, touch=True)))
        self.pool.match_units(request, touch=True)
        local = split_units(request, unit, first, local_end)
        remote = split_units(request, unit, local_end, last)
        self.locals[server].store(request, stop)
        self.path.load(server, slot, remote, local, on_done)

    def save(self, server: int, slot: int, request: LvRequest, computed: int, on_done: Done) -> None:
        self.locals[server].store(request, computed)
        added = self.pool.store(request, computed)
        if not added:
            on_done()
            return
        self.path.store(server, slot, added, on_done)


Backend = CxlBackend | RdmaBackend


def make_backend(loop: EventLoop, setup: PoolSetup, system: SystemSpec) -> Backend:
    return CxlBackend(loop, setup, system) if system.is_cxl else RdmaBackend(loop, setup, system)

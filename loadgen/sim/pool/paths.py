"""The data paths on the simulated clock: a load or store waits its fixed cost (`costs.py`), then moves its
bytes as concurrent flows on fluid links (`loadgen/sim/fluid.py`) and ends when the last flow does.

* `CxlPath` (Beluga): GPU <-> its socket's PCIe/CXL adapter (GPUs 0-3 on socket 0, I) <-> the memory devices
  holding the blocks. The metadata server allocates pool offsets in store order. Interleaved: 2 MB granules
  round-robin over the 32 devices, so a request's blocks spread evenly over all of them. Not interleaved:
  offsets map onto consecutive 256 GB devices, so the pool fills device after device, and requests close in
  the trace (stored together, read together) crowd onto the same device.
* `RdmaPath` (baseline): GPU <-> host bounce buffer over the GPU's PCIe, and for objects of the RDMA pool
  host <-> the object's home server over the NICs (send side and receive side); objects alternate between the
  two servers' DRAM (remote half the time, I), a local object goes through the NIC's loopback. A store
  holds the step only for its copy into host memory; the put to the pool runs in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loadgen.sim.events import EventLoop
from loadgen.sim.fluid import FluidLink
from loadgen.sim.pool.costs import CxlCosts, KvGeometry, RdmaCosts
from loadgen.sim.pool.tiers import SegmentKey, UnitRange

Done = Callable[[], None]
Flow = tuple[FluidLink, float]


def run_transfer(loop: EventLoop, fixed_s: float, flows: Sequence[Flow], on_done: Done) -> None:
    """After `fixed_s`, start every flow at once; `on_done()` when the last has moved its bytes."""

    def start() -> None:
        live = [(link, size) for link, size in flows if size > 0]
        if not live:
            on_done()
            return
        left = [len(live)]

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                on_done()

        for link, size in live:
            link.start(size, one_done)

    loop.after(fixed_s, start)


class CxlPath:
    __slots__ = (
        "_cursor",
        "_extents",
        "block_bytes",
        "costs",
        "devices",
        "geometry",
        "is_interleaved",
        "loop",
        "reads",
        "socket_gpus",
        "writes",
    )

    def __init__(
        self,
        loop: EventLoop,
        costs: CxlCosts,
        geometry: KvGeometry,
        num_servers: int,
        gpus_per_server: int,
        *,
        is_interleaved: bool,
    ) -> None:
        self.loop = loop
        self.costs = costs
        self.geometry = geometry
        self.is_interleaved = is_interleaved
        self.block_bytes = costs.block_tokens * geometry.kv_bytes_per_token
        self.socket_gpus = gpus_per_server // costs.adapters_per_server
        adapters = [(s, a) for s in range(num_servers) for a in range(costs.adapters_per_server)]
        bw = costs.adapter_bytes_per_s
        self.reads = {k: FluidLink(loop, bw, name=f"cxl-read-{k[0]}.{k[1]}") for k in adapters}
        self.writes = {k: FluidLink(loop, bw, name=f"cxl-write-{k[0]}.{k[1]}") for k in adapters}
        device_bw = costs.device_bytes_per_s
        self.devices = [FluidLink(loop, device_bw, name=f"cxl-dev-{d}") for d in range(costs.num_devices)]
        self._extents: dict[SegmentKey, list[tuple[int, int, float]]] = {}  # (first unit, units, offset)
        self._cursor = 0.0  # next free pool offset: the metadata server's one allocator (brief 4.5, 4.6)

    def _adapter(self, server: int, slot: int) -> tuple[int, int]:
        return server, min(slot // self.socket_gpus, self.costs.adapters_per_server - 1)

    def load(self, server: int, slot: int, ranges: Sequence[UnitRange], on_done: Done) -> None:
        """Scatter-read the blocks of `ranges` into the GPU's cache: one kernel (O5)."""
        blocks = sum(r.count for r in ranges)
        fixed = self.costs.load_fixed_s(blocks, self.geometry.chunks_per_block)
        size = blocks * self.block_bytes
        flows = [(self.reads[self._adapter(server, slot)], size)]
        run_transfer(self.loop, fixed, flows + self._device_flows(ranges), on_done)

    def store(self, server: int, slot: int, ranges: Sequence[UnitRange], on_done: Done) -> None:
        """Allocate pool space for new blocks and gather-write them: one kernel, ALLOC and COMMIT RPCs."""
        for r in ranges:
            self._allocate(r)
        blocks = sum(r.count for r in ranges)
        fixed = self.costs.store_fixed_s(blocks, self.geometry.chunks_per_block)
        size = blocks * self.block_bytes
        flows = [(self.writes[self._adapter(server, slot)], size)]
        run_transfer(self.loop, fixed, flows + self._device_flows(ranges), on_done)

    def _allocate(self, r: UnitRange) -> None:
        """The metadata server hands out pool offsets in order, as a ring once the 2 TB are used (I)."""
        size = r.count * self.block_bytes
        if self._cursor + size > self.costs.pool_bytes:
            self._cursor = 0.0
        if r.first == 0:
            self._extents[r.key] = []  # stored again from its start: it was evicted, its old place is gone
        self._extents.setdefault(r.key, []).append((r.first, r.count, self._cursor))
        self._cursor += size

    def _device_flows(self, ranges: Sequence[UnitRange]) -> list[Flow]:
        if self.is_interleaved:  # 2 MB granules round-robin: a request's blocks cover every device alike
            share = sum(r.count for r in ranges) * self.block_bytes / len(self.devices)
            return [(device, share) for device in self.devices]
        per_device: dict[int, float] = {}
        for r in ranges:
            for offset, size in self._byte_spans(r):
                self._add_spans(per_device, offset, size)
        return [(self.devices[d], size) for d, size in sorted(per_device.items())]

    def _byte_spans(self, r: UnitRange) -> list[tuple[float, float]]:
        """Pool offsets and sizes of units [first, first + count) of a segment."""
        spans: list[tuple[float, float]] = []
        for first, units, offset in self._extents.get(r.key, ()):
            lo, hi = max(first, r.first), min(first + units, r.first + r.count)
            if hi > lo:
                spans.append((offset + (lo - first) * self.block_bytes, (hi - lo) * self.block_bytes))
        return spans

    def _add_spans(self, per_device: dict[int, float], offset: float, size: float) -> None:
        device_bytes = self.costs.device_bytes
        while size > 0:
            device = int(offset // device_bytes) % len(self.devices)
            part = min(size, (int(offset // device_bytes) + 1) * device_bytes - offset)
            per_device[device] = per_device.get(device, 0.0) + part
            offset, size = offset + part, size - part


class RdmaPath:
    __slots__ = ("costs", "d2h", "geometry", "h2d", "loop", "nic_rx", "nic_tx", "object_bytes")

    def __init__(
        self, loop: EventLoop, costs: RdmaCosts, geometry: KvGeometry, num_servers: int, gpus_per_server: int
    ) -> None:
        self.loop = loop
        self.costs = costs
        self.geometry = geometry
        self.object_bytes = costs.object_tokens * geometry.kv_bytes_per_token
        nic, pcie = costs.nic_bytes_per_s, costs.pcie_bytes_per_s
        self.nic_tx = [FluidLink(loop, nic, name=f"nic-tx-{s}") for s in range(num_servers)]
        self.nic_rx = [FluidLink(loop, nic, name=f"nic-rx-{s}") for s in range(num_servers)]
        gpus = [(s, g) for s in range(num_servers) for g in range(gpus_per_server)]
        self.h2d = {k: FluidLink(loop, pcie, name=f"h2d-{k[0]}.{k[1]}") for k in gpus}
        self.d2h = {k: FluidLink(loop, pcie, name=f"d2h-{k[0]}.{k[1]}") for k in gpus}

    def home_of(self, key: SegmentKey, unit: int) -> int:
        """The server whose DRAM holds an object: consecutive objects alternate (I)."""
        return (key[1] + unit) % self.costs.num_pool_servers

    def _home_bytes(self, ranges: Sequence[UnitRange]) -> dict[int, float]:
        per_home: dict[int, float] = {}
        for r in ranges:
            for unit in range(r.first, r.first + r.count):
                home = self.home_of(r.key, unit)
                per_home[home] = per_home.get(home, 0.0) + self.object_bytes
        return per_home

    def load(
        self, server: int, slot: int, pool: Sequence[UnitRange], local: Sequence[UnitRange], on_done: Done
    ) -> None:
        """Objects from the server's local DRAM tier and from the RDMA pool, through the bounce buffer."""
        num_pool, num_local = sum(r.count for r in pool), sum(r.count for r in local)
        size = (num_pool + num_local) * self.object_bytes
        fixed = self.costs.load_fixed_s(num_pool, num_local, self.geometry.chunks_per_block, size)
        flows: list[Flow] = [(self.h2d[server, slot], size)]
        for home, part in self._home_bytes(pool).items():
            flows += [(self.nic_tx[home], part), (self.nic_rx[server], part)]
        run_transfer(self.loop, fixed, flows, on_done)

    def store(self, server: int, slot: int, pool: Sequence[UnitRange], on_done: Done) -> None:
        """New objects into host memory (the local DRAM tier) within the step; their put to the pool then
        moves over the NICs in the background."""
        num_pool = sum(r.count for r in pool)
        size = num_pool * self.object_bytes
        nic_flows: list[Flow] = []
        for home, part in self._home_bytes(pool).items():
            nic_flows += [(self.nic_tx[server], part), (self.nic_rx[home], part)]
        run_transfer(self.loop, 0.0, nic_flows, _nothing)
        run_transfer(self.loop, self.costs.store_fixed_s(num_pool), [(self.d2h[server, slot], size)], on_done)


def _nothing() -> None:
    return None

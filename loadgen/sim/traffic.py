"""Per-link byte counters, charged hop by hop as brief 3.3-3.5 and section 4 label the two read paths.

CNIC directions are the PCIe side the analysis checks: "read" is the NIC reading host or GPU memory
(DRAM -> CNIC, HBM -> CNIC), "write" the NIC writing it. DRAM is half-duplex, so reads and writes add up.
SNIC bytes are counted by the fluid links themselves; these counters cover the CNICs, the DRAM buffers and
the bytes that cross the compute network between nodes. They are accounting only: CNIC and DRAM limits
are not enforced (the analysis says they hold inside the bottleneck-free P/D range, which the report
checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadgen.sim.requests import SimRequest
from services.policy.snapshot import ReadSide


@dataclass(slots=True)
class TrafficCounters:
    kv_bytes_per_token: float
    pe_cnic_read: dict[int, float] = field(default_factory=dict)  # by PE index
    pe_cnic_write: dict[int, float] = field(default_factory=dict)
    de_cnic_read: dict[int, float] = field(default_factory=dict)  # by DE index
    de_cnic_write: dict[int, float] = field(default_factory=dict)
    dram: dict[int, float] = field(default_factory=dict)  # by node
    network_bytes: float = 0.0
    hit_bytes_by_side: dict[str, float] = field(default_factory=lambda: {"pe": 0.0, "de": 0.0})

    @staticmethod
    def _add(counter: dict[int, float], key: int, num_bytes: float) -> None:
        counter[key] = counter.get(key, 0.0) + num_bytes

    def read_into_buffer(self, request: SimRequest) -> None:
        """Storage -> SNIC -> the read side's DRAM buffer (PE path steps 1-2, DE path steps 1-2)."""
        hit = request.read_tokens * self.kv_bytes_per_token
        self._add(self.dram, request.read_node, hit)
        if request.read_side is not None:
            self.hit_bytes_by_side[request.read_side.value] += hit

    def prefill(self, request: SimRequest) -> None:
        """Everything the request's prefill moved, charged when its last chunk is done."""
        hit = request.read_tokens * self.kv_bytes_per_token
        miss = (request.prompt_tokens - request.read_tokens) * self.kv_bytes_per_token
        pe, de = request.pe_index, request.de_index
        pe_node, de_node = request.pe_node, request.de_node
        if request.read_side is ReadSide.DE:
            self._add(self.dram, de_node, hit + miss)  # DE buffer -> CNIC (3), miss KV back into it
            self._add(self.de_cnic_read, de, hit)  # (3)
            self._add(self.pe_cnic_write, pe, hit)  # (5)
            self._add(self.pe_cnic_read, pe, miss)  # miss KV HBM -> CNIC
            self._add(self.de_cnic_write, de, miss)
            self.network_bytes += hit + miss if pe_node != de_node else 0.0
            return
        whole = hit + miss
        self._add(self.dram, pe_node, hit)  # PE buffer -> CNIC (3)
        self._add(self.pe_cnic_read, pe, hit + whole)  # (3) and (5)
        self._add(self.pe_cnic_write, pe, hit)  # (4)
        self._add(self.de_cnic_write, de, whole)  # (7)
        self._add(self.dram, de_node, whole)
        self.network_bytes += whole if pe_node != de_node else 0.0

    def decode_h2d(self, request: SimRequest) -> None:
        """DE buffer -> DE HBM through the DE's CNIC (PE path 8-9, DE path 6-7)."""
        whole = request.prompt_tokens * self.kv_bytes_per_token
        self._add(self.dram, request.de_node, whole)
        self._add(self.de_cnic_read, request.de_index, whole)
        self._add(self.de_cnic_write, request.de_index, whole)

    def persist(self, request: SimRequest, num_bytes: float) -> None:
        """New full blocks: DE HBM -> CNIC -> DRAM -> SNIC (the SNIC link counts its own bytes)."""
        self._add(self.de_cnic_read, request.de_index, num_bytes)
        self._add(self.de_cnic_write, request.de_index, num_bytes)
        self._add(self.dram, request.de_node, 2 * num_bytes)

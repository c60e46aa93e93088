"""Beluga at the paper's scale: colocated vLLM instances over a shared KV tier, a CXL pool (Beluga) against an
RDMA pool (vLLM + LMCache + MoonCake store), on the simulator's event loop and fluid links.

See loadgen/README.md ("Beluga at paper scale"). Entry points: `beluga_sweep(PoolSimConfig(...))`,
`kvpath loadgen sim --sweep beluga`.
"""

from loadgen.sim.pool.cluster import PoolCluster
from loadgen.sim.pool.config import PoolSetup, PoolSimConfig, SystemSpec, resolve
from loadgen.sim.pool.report import format_beluga
from loadgen.sim.pool.sweep import beluga_sweep
from loadgen.sim.pool.workload import LvRequest, LvShape, build_lv_trace

__all__ = [
    "LvRequest",
    "LvShape",
    "PoolCluster",
    "PoolSetup",
    "PoolSimConfig",
    "SystemSpec",
    "beluga_sweep",
    "build_lv_trace",
    "format_beluga",
    "resolve",
]

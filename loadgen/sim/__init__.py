"""Discrete-event simulator of a DualPath cluster running the project's own placement and batching policies.

See loadgen/README.md ("Cluster simulator"). Entry points: `simulate(SimConfig(...))`, `kvpath loadgen sim`.
"""

from loadgen.sim.config import SimConfig, SimSetup, resolve
from loadgen.sim.simulate import format_summary, simulate, simulate_raw
from loadgen.sim.workload import AgentPlan, Workload, build_workload

__all__ = [
    "AgentPlan",
    "SimConfig",
    "SimSetup",
    "Workload",
    "build_workload",
    "format_summary",
    "resolve",
    "simulate",
    "simulate_raw",
]

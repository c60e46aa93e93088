"""AMPD in the simulator: the cluster model (`cluster.py`) running the project's Algorithms 1 and 2, and the
paper-scale setups, ablation and sweeps (`paper.py`) behind `kvpath bench ampd --sim`."""

from loadgen.sim.ampd.paper import VARIANTS, Variant, paper_attainment, sensitivity, simulate

__all__ = ["VARIANTS", "Variant", "paper_attainment", "sensitivity", "simulate"]

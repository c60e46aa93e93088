"""`SimConfig`: every knob of `kvpath loadgen sim` (CLI flag, `KVPATH_<FIELD>` env, YAML section `sim:`), and
`SimSetup`, the resolved numbers a run uses (model with overrides applied, bandwidths in bytes/s)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from loadgen.profiles import PROFILES
from loadgen.sim.models import GB, SimModel, get_model
from services.policy.table_placement import POLICIES
from shared.config import check, doc
from shared.errors import ConfigError

MODES = ("offline", "online")
LAYERWISE = ("auto", "on", "off")
BETA_RATES = ("prompt", "computed")
PREFILL_ORDERS = ("fcfs", "short-first")
MALS = ("32k", "48k", "64k")


@dataclass(slots=True)
class SimConfig:
    model: str = doc("ds27b", "model preset: ds27b, ds660b or qwen32b")
    config: str = doc(
        "", "cluster as xPyD (prefill nodes, decode nodes), e.g. 1P1D; empty: the model's default"
    )
    policy: str = doc("dualpath", "placement policy: dualpath, basic or dualpath-rr")
    mode: str = doc("offline", "offline: every agent starts at t=0 (JCT); online: Poisson arrivals at --aps")
    agents: int = doc(512, "offline: number of agents")
    mal: str = doc("64k", "maximum agent length: 32k, 48k or 64k (the dualpath-<mal> trace profile)")
    aps: float = doc(0.0, "online: agent arrivals per second")
    duration_s: float = doc(600.0, "online: simulated seconds of arrivals (the run ends then)")
    warmup_s: float = doc(0.0, "online: requests sent before this are not measured")
    seed: int = doc(0, "seed of the trace and of the arrivals")
    layerwise: str = doc("auto", "layerwise prefill: auto (off for basic, on otherwise), on or off")
    oracle: bool = doc(False, "every read, copy and transfer takes no time (the paper's Oracle)")
    gpus_per_node: int = doc(8, "GPUs (engines) per node")
    cnic_gbit_per_s: float = doc(400.0, "compute NIC bandwidth per GPU, Gbit/s (B)")
    storage_ratio: float = doc(1.0, "storage NIC bandwidth per node as a multiple of B (s)")
    dram_gbyte_per_s: float = doc(500.0, "DRAM bandwidth per node, GB/s (M; reported, not enforced)")
    kv_share: float = doc(0.9, "share of a CNIC that KV copies get next to the model's collectives")
    net_gbit_per_s: float = doc(0.0, "DE->PE KV stream over the compute network, Gbit/s; 0: the CNIC's")
    linear_tflops: float = doc(0.0, "effective non-attention TFLOP/s per GPU; 0: the model's default")
    attention_tflops: float = doc(0.0, "effective attention TFLOP/s per GPU; 0: the model's default")
    compute_quota_s: float = doc(0.3, "PE compute quota: predicted attention-layer seconds per batch")
    max_batch_tokens: int = doc(65536, "most new tokens in one PE batch")
    alpha_s: float = doc(3.0, "alpha: a node read queue under this many seconds of reads is short")
    beta_s: float = doc(5.0, "beta: a PE with more than this many seconds of prefill gets no request")
    z_factor: float = doc(1.05, "DE high-token threshold multiplier")
    beta_rate: str = doc("prompt", "PE rate behind beta: prompt tokens (hit + miss) or computed tokens per s")
    prefill_order: str = doc(
        "fcfs",
        "fcfs | short-first: the placement queue and every PE's queue fewest tokens to compute first, and "
        "past beta on a PE whose shorter work takes under beta_s (the live --prefill-order)",
    )
    block_size: int = doc(64, "tokens per KV block: hits are rounded down to whole blocks")
    fetch_period_s: float = doc(0.01, "at most one placement round per this many seconds (0: every change)")
    tpot_s: float = doc(0.0, "constant decode step seconds; 0: the model's linear step model")
    dram_buffer_gb: float = doc(0.0, "DRAM buffer per node, GB; 0: the model's default")
    de_kv_gb: float = doc(0.0, "HBM for KV per decode GPU, GB; 0: the model's default")
    pe_kv_gb: float = doc(0.0, "HBM for KV per prefill GPU (non-layerwise batches), GB; 0: the model's")
    max_concurrent_reads: int = doc(8, "reads in flight per storage NIC, the rest wait FIFO (0: no limit)")
    append_scale: float = doc(1.0, "multiply every append (trajectories end at the MAL)")
    gen_scale: float = doc(1.0, "multiply every generation (trajectories end at the MAL)")
    base_trajectories: int = doc(500, "agents replay this many base trajectories behind a random first round")
    first_round_tokens: int = doc(64, "length of that random first round (it generates one token)")
    balance_window_s: float = doc(1.0, "window of the storage max/avg balance ratio")
    balance_min_load: float = doc(0.5, "skip balance windows below this share of the busiest window")
    max_sim_s: float = doc(0.0, "stop the simulated clock here; 0: when the work is done")
    ttft_slo_s: float = doc(4.0, "TTFT SLO")
    tpot_slo_s: float = doc(0.05, "TPOT SLO")
    report_window_s: float = doc(150.0, "online: the last window whose mean TTFT is reported (steady check)")

    def validate(self) -> None:
        get_model(self.model)
        if self.config:
            parse_pd(self.config)
        check(self.policy in POLICIES, "policy", self.policy, f"one of {', '.join(POLICIES)}")
        check(self.mode in MODES, "mode", self.mode, f"one of {', '.join(MODES)}")
        check(self.mal in MALS, "mal", self.mal, f"one of {', '.join(MALS)}")
        check(self.layerwise in LAYERWISE, "layerwise", self.layerwise, f"one of {', '.join(LAYERWISE)}")
        check(self.beta_rate in BETA_RATES, "beta_rate", self.beta_rate, f"one of {', '.join(BETA_RATES)}")
        check(
            self.prefill_order in PREFILL_ORDERS, "prefill_order", self.prefill_order, "fcfs or short-first"
        )
        check(self.agents >= 1, "agents", self.agents, "must be >= 1")
        check(self.mode == "offline" or self.aps > 0, "aps", self.aps, "online mode needs --aps > 0")
        for name in ("cnic_gbit_per_s", "storage_ratio", "dram_gbyte_per_s", "compute_quota_s", "alpha_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for name in ("beta_s", "z_factor", "append_scale", "gen_scale", "balance_window_s", "duration_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        check(0 < self.kv_share <= 1, "kv_share", self.kv_share, "must be in (0, 1]")
        check(0 <= self.balance_min_load <= 1, "balance_min_load", self.balance_min_load, "must be in [0, 1]")
        for name in ("gpus_per_node", "block_size", "max_batch_tokens", "first_round_tokens"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("net_gbit_per_s", "linear_tflops", "attention_tflops", "fetch_period_s", "tpot_s"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("dram_buffer_gb", "de_kv_gb", "pe_kv_gb", "max_sim_s", "warmup_s"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        check(
            self.max_concurrent_reads >= 0, "max_concurrent_reads", self.max_concurrent_reads, "must be >= 0"
        )
        check(self.base_trajectories >= 0, "base_trajectories", self.base_trajectories, "must be >= 0")


def parse_pd(text: str) -> tuple[int, int]:
    """'2P4D' -> (2, 4)."""
    match = re.fullmatch(r"\s*(\d+)\s*[Pp]\s*(\d+)\s*[Dd]\s*", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ConfigError(f"invalid config {text!r}: expected xPyD with x, y >= 1, e.g. 1P1D", param="config")
    return int(match[1]), int(match[2])


@dataclass(frozen=True, slots=True)
class SimSetup:
    """The numbers one run uses, resolved from a `SimConfig` (bandwidths in bytes/s)."""

    config: SimConfig
    model: SimModel
    num_prefill_nodes: int
    num_decode_nodes: int
    gpus_per_node: int
    snic_bytes_per_s: float  # per node, each direction; inf for the Oracle
    kv_copy_bytes_per_s: float  # a GPU's CNIC share for KV (loopback H2D/D2H, PE<->DE); inf for the Oracle
    net_bytes_per_s: float  # one DE->PE stream over the compute network; inf for the Oracle
    cnic_bytes_per_s: float  # B, for the utilization report
    dram_bytes_per_s: float  # M, for the utilization report
    is_layerwise: bool
    profile_name: str

    @property
    def num_nodes(self) -> int:
        return self.num_prefill_nodes + self.num_decode_nodes

    @property
    def pd_label(self) -> str:
        return f"{self.num_prefill_nodes}P{self.num_decode_nodes}D"


def resolve(config: SimConfig) -> SimSetup:
    config.validate()
    base = get_model(config.model)
    model = replace(
        base,
        linear_flops_per_s=config.linear_tflops * 1e12 or base.linear_flops_per_s,
        attention_flops_per_s=config.attention_tflops * 1e12 or base.attention_flops_per_s,
        dram_buffer_bytes=config.dram_buffer_gb * GB or base.dram_buffer_bytes,
        de_kv_bytes=config.de_kv_gb * GB or base.de_kv_bytes,
        pe_kv_bytes=config.pe_kv_gb * GB or base.pe_kv_bytes,
    )
    num_p, num_d = parse_pd(config.config or model.default_pd)
    cnic = config.cnic_gbit_per_s * 1e9 / 8
    net = (config.net_gbit_per_s * 1e9 / 8 or cnic) * config.kv_share
    io = math.inf if config.oracle else 1.0
    layerwise = config.layerwise == "on" or (config.layerwise == "auto" and config.policy != "basic")
    profile = f"dualpath-{config.mal}"
    assert profile in PROFILES
    return SimSetup(
        config=config,
        model=model,
        num_prefill_nodes=num_p,
        num_decode_nodes=num_d,
        gpus_per_node=config.gpus_per_node,
        snic_bytes_per_s=io * config.storage_ratio * cnic,
        kv_copy_bytes_per_s=io * cnic * config.kv_share,
        net_bytes_per_s=io * net,
        cnic_bytes_per_s=cnic,
        dram_bytes_per_s=config.dram_gbyte_per_s * 1e9,
        is_layerwise=layerwise,
        profile_name=profile,
    )

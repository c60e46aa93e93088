"""`PoolSimConfig`: the knobs of `kvpath loadgen sim --sweep beluga`, with the paper's setup as defaults, and
`PoolSetup`, the cost models a run uses.

The sweep reads only these fields (flags of their own, `KVPATH_<FIELD>` or a YAML section `sim_pool:`) and
`--seed`; the DualPath flags of `SimConfig` do not apply to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadgen.sim.pool.compute import StepModel
from loadgen.sim.pool.costs import GB, CxlCosts, KvGeometry, RdmaCosts
from loadgen.sim.pool.workload import LvShape
from shared.config import check, doc


@dataclass(slots=True)
class PoolSimConfig:
    servers: int = doc(2, "GPU servers (paper: 2)")
    gpus_per_server: int = doc(8, "GPUs per server, one vLLM instance each (paper: 8 H20)")
    clients: int = doc(40, "closed-loop clients (inferred from Table 5 by Little's law)")
    requests: int = doc(400, "LV-Eval-like requests per run (the working set must fit the 2 TB pool)")
    seed: int = doc(0, "seed of the trace")
    repeat_share: float = doc(0.3, "share of requests about an already-asked document (paper: 0.3 hit ratio)")
    shared_doc_questions: int = doc(5, "questions per shared document")
    min_prompt_tokens: int = doc(15_360, "shortest prompt (paper: every input over 15K tokens)")
    max_prompt_tokens: int = doc(24_576, "longest prompt (LV-Eval's 16K level; keeps H20 prefill in range)")
    step_tokens: int = doc(8192, "tokens per continuous-batching step (vLLM max_num_batched_tokens)")
    h20_tflops: float = doc(105.0, "effective bf16 TFLOP/s of one H20 (calibrated: populate TTFT)")
    hbm_kv_gb: float = doc(28.3, "HBM for KV per GPU, GB (paper 7.1)")
    pool_gb: float = doc(2000.0, "shared pool capacity, GB, both systems (paper: capped at 2 TB)")
    cxl_load_overhead_ms: float = doc(
        800.0, "Beluga: software time per load (calibrated: the paper's cache-hit TPOT of 0.15 s), ms"
    )
    local_dram_gb: float = doc(40.0, "baseline: LMCache local DRAM tier per server, GB")
    rdma_object_overhead_ms: float = doc(45.0, "baseline: per object a retrieve handles, ms (calibrated)")
    rdma_copy_gbyte_per_s: float = doc(0.8, "baseline: the retrieve's extra host copy, GB/s (calibrated)")
    sensitivity: bool = doc(True, "also run the baseline at 16-token objects and Beluga without interleaving")

    def validate(self) -> None:
        for name in ("servers", "gpus_per_server", "clients", "requests", "step_tokens"):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        for name in ("h20_tflops", "hbm_kv_gb", "pool_gb", "local_dram_gb", "rdma_copy_gbyte_per_s"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        for name in ("cxl_load_overhead_ms", "rdma_object_overhead_ms"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        check(self.gpus_per_server % 2 == 0, "gpus_per_server", self.gpus_per_server, "even: 2 sockets")
        self.shape().validate()

    def shape(self) -> LvShape:
        return LvShape(
            num_requests=self.requests,
            repeat_share=self.repeat_share,
            questions_per_shared_doc=self.shared_doc_questions,
            min_prompt_tokens=self.min_prompt_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
        )


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """One system of the comparison: Beluga's CXL pool or the RDMA baseline, and its variant."""

    name: str
    is_cxl: bool
    object_tokens: int = 256  # baseline: tokens per stored object
    is_interleaved: bool = True  # Beluga: 2 MB interleaving over every device

    @property
    def is_cache_aware(self) -> bool:
        return not self.is_cxl


BELUGA = SystemSpec("vLLM+Beluga", is_cxl=True)
MOONCAKE = SystemSpec("vLLM+MoonCake", is_cxl=False)
MOONCAKE_16 = SystemSpec("vLLM+MoonCake, 16-token blocks", is_cxl=False, object_tokens=16)
BELUGA_FLAT = SystemSpec("vLLM+Beluga, no interleaving", is_cxl=True, is_interleaved=False)


@dataclass(frozen=True, slots=True)
class PoolSetup:
    config: PoolSimConfig
    geometry: KvGeometry = field(default_factory=KvGeometry)
    cxl: CxlCosts = field(default_factory=CxlCosts)
    rdma: RdmaCosts = field(default_factory=RdmaCosts)
    step: StepModel = field(default_factory=StepModel)

    @property
    def num_instances(self) -> int:
        return self.config.servers * self.config.gpus_per_server

    @property
    def hbm_blocks(self) -> int:
        return int(self.config.hbm_kv_gb * GB / (self.cxl.block_tokens * self.geometry.kv_bytes_per_token))


def resolve(config: PoolSimConfig) -> PoolSetup:
    config.validate()
    geometry = KvGeometry()
    return PoolSetup(
        config=config,
        geometry=geometry,
        cxl=CxlCosts(pool_bytes=config.pool_gb * GB, load_overhead_s=config.cxl_load_overhead_ms / 1e3),
        rdma=RdmaCosts(
            pool_bytes=config.pool_gb * GB,
            num_pool_servers=config.servers,
            local_dram_bytes=config.local_dram_gb * GB,
            object_overhead_s=config.rdma_object_overhead_ms / 1e3,
            copy_bytes_per_s=config.rdma_copy_gbyte_per_s * GB,
        ),
        step=StepModel(kv_bytes_per_token=geometry.kv_bytes_per_token, flops_per_s=config.h20_tflops * 1e12),
    )

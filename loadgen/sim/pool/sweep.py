"""`kvpath loadgen sim --sweep beluga`: the paper's Exp #5 (Table 5) and, with `--sensitivity`, two of Exp #8.

Each system gets a fresh cluster that replays the trace twice: the cache-populate run (empty tiers), then the
cache-hit run (the same requests, every prompt now in the pool). Headline: `sim_ttft_reduction` = 1 - Beluga's
cache-hit mean TTFT / the baseline's (paper 0.896) and `sim_qps_speedup` (paper 7.35). Sensitivity: the
baseline with 16-token objects (paper: cache-hit TTFT 76.8 s against 13.0 s) and Beluga without
interleaving (paper: QPS 8.49 against 11.32).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

from loadgen.sim.pool.cluster import PoolCluster
from loadgen.sim.pool.config import (
    BELUGA,
    BELUGA_FLAT,
    MOONCAKE,
    MOONCAKE_16,
    PoolSetup,
    PoolSimConfig,
    SystemSpec,
    resolve,
)
from loadgen.sim.pool.workload import LvRequest, build_lv_trace
from shared.config import build_config

Progress = Callable[[str], None]
RUNS = ("populate", "hit")
TABLE5_FIELDS = ("ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "qps")
# Table 5, vLLM+MoonCake and vLLM+Beluga: mean / P99 TTFT (s), mean TPOT (s), QPS
PAPER_TABLE5: dict[tuple[str, str], dict[str, float]] = {
    ("populate", MOONCAKE.name): dict(zip(TABLE5_FIELDS, (19.66, 41.65, 1.97, 1.02), strict=True)),
    ("populate", BELUGA.name): dict(zip(TABLE5_FIELDS, (17.22, 44.6, 1.54, 1.24), strict=True)),
    ("hit", MOONCAKE.name): dict(zip(TABLE5_FIELDS, (13.00, 39.91, 1.10, 1.54), strict=True)),
    ("hit", BELUGA.name): dict(zip(TABLE5_FIELDS, (1.36, 5.02, 0.15, 11.32), strict=True)),
}
PAPER = {
    "ttft_reduction": 0.896,
    "qps_speedup": 7.35,
    "populate_ttft_reduction": 0.124,
    "populate_qps_gain": 0.215,
    "mooncake_16_hit_ttft_s": 76.8,
    "mooncake_256_hit_ttft_s": 13.0,
    "beluga_no_interleave_hit_qps": 8.49,
    "beluga_interleave_hit_qps": 11.32,
}


def _quiet(_: str) -> None:
    return None


def beluga_config(args: argparse.Namespace) -> PoolSimConfig:
    """The sweep's config from the command line: its own flags and `--seed` (YAML section `sim_pool:`)."""
    names = PoolSimConfig.__dataclass_fields__
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    # shared.config binds its type variable to BaseConfig; PoolSimConfig has its shape without the bus fields
    return build_config(  # type: ignore[type-var]
        PoolSimConfig, section="sim_pool", yaml_path=getattr(args, "config_file", None), overrides=overrides
    )


def _row(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "system": summary["system"],
        "run": summary["run"],
        "requests": summary["requests"],
        "ttft_mean_s": summary["ttft_s"]["mean"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
        "tpot_mean_s": summary["tpot_s"]["mean"],
        "tpot_p99_s": summary["tpot_s"]["p99"],
        "qps": summary["qps"],
        "qps_makespan": summary["qps_makespan"],
        "makespan_s": summary["makespan_s"],
        "hit_ratio": summary["hit_ratio"],
        "hbm_hit_ratio": summary["hbm_hit_ratio"],
        "load_mean_s": summary["load_s"]["mean"],
        "paper": PAPER_TABLE5.get((summary["run"], summary["system"])),
    }


def run_system(
    setup: PoolSetup, system: SystemSpec, trace: tuple[LvRequest, ...], progress: Progress = _quiet
) -> dict[str, dict[str, Any]]:
    """Both runs of one system on one cluster: {"populate": row, "hit": row}."""
    cluster = PoolCluster(setup, system)
    rows = {}
    for run in RUNS:
        started = time.perf_counter()
        row = _row(cluster.run(trace, run))
        rows[run] = row
        progress(
            f"{system.name} {run}: TTFT {row['ttft_mean_s']:.2f} s, QPS {row['qps']:.2f} "
            f"({time.perf_counter() - started:.1f} s wall)"
        )
    return rows


def _ratios(beluga: dict[str, dict[str, Any]], mooncake: dict[str, dict[str, Any]]) -> dict[str, float]:
    def reduction(run: str) -> float:
        return 1.0 - beluga[run]["ttft_mean_s"] / mooncake[run]["ttft_mean_s"]

    def speedup(run: str) -> float:
        return float(beluga[run]["qps"] / mooncake[run]["qps"])

    return {
        "sim_ttft_reduction": reduction("hit"),
        "sim_qps_speedup": speedup("hit"),
        "sim_populate_ttft_reduction": reduction("populate"),
        "sim_populate_qps_gain": speedup("populate") - 1.0,
    }


def _setup_summary(setup: PoolSetup, trace: tuple[LvRequest, ...]) -> dict[str, Any]:
    prompts = [r.prompt_tokens for r in trace]
    return {
        **dataclasses.asdict(setup.config),
        "instances": setup.num_instances,
        "kv_bytes_per_token": setup.geometry.kv_bytes_per_token,
        "hbm_blocks": setup.hbm_blocks,
        "documents": len({r.doc_id for r in trace}),
        "prompt_tokens_mean": statistics.fmean(prompts),
        "output_tokens_mean": statistics.fmean(r.output_tokens for r in trace),
        "rdma_object_overhead_ms": setup.rdma.object_overhead_s * 1e3,
        "rdma_copy_gbyte_per_s": setup.rdma.copy_bytes_per_s / 1e9,
    }


def beluga_sweep(config: PoolSimConfig, progress: Progress = _quiet) -> dict[str, Any]:
    started = time.perf_counter()
    setup = resolve(config)
    trace = build_lv_trace(config.shape(), config.seed)
    beluga = run_system(setup, BELUGA, trace, progress)
    mooncake = run_system(setup, MOONCAKE, trace, progress)
    sensitivity = None
    if config.sensitivity:
        sensitivity = {
            "mooncake_16": run_system(setup, MOONCAKE_16, trace, progress)["hit"],
            "beluga_no_interleave": run_system(setup, BELUGA_FLAT, trace, progress)["hit"],
        }
    rows = [mooncake["populate"], beluga["populate"], mooncake["hit"], beluga["hit"]]
    return {
        "experiment": "beluga",
        **_ratios(beluga, mooncake),
        "rows": rows,
        "sensitivity": sensitivity,
        "paper": PAPER,
        "setup": _setup_summary(setup, trace),
        "wall_s": time.perf_counter() - started,
    }

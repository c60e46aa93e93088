"""Summaries of a simulated run: JCT, TTFT / TTST / TPOT and the TTFT breakdown, storage balance (the live
metric, `dualpath.storage_balance`), per-link traffic against capacity and the analysis, scheduler cost."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from loadgen.balance import storage_balance
from loadgen.metrics import distribution
from loadgen.sim.analysis import bottleneck_free_range, expected_link_rates
from loadgen.sim.config import SimSetup
from loadgen.sim.lifecycle import RawRun
from loadgen.sim.requests import RECORD_FIELDS

COL = {name: i for i, name in enumerate(RECORD_FIELDS)}


def _column(records: npt.NDArray[np.float64], name: str) -> npt.NDArray[np.float64]:
    return records[:, COL[name]]


def _mean(values: npt.NDArray[np.float64]) -> float | None:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else None


def latency_summary(records: npt.NDArray[np.float64], lo_s: float = 0.0) -> dict[str, Any]:
    """TTFT, TTST, TPOT (loadgen's definitions) and the TTFT breakdown of requests sent at or after `lo_s`."""
    if records.size:
        records = records[_column(records, "arrival_s") >= lo_s]
    if not records.size:
        return {"requests": 0}
    arrival, first = _column(records, "arrival_s"), _column(records, "first_token_s")
    second, finish = _column(records, "second_token_s"), _column(records, "finish_s")
    gen = _column(records, "gen_tokens")
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(gen > 1, (finish - first) / (gen - 1), np.nan)
    stages = ("arrival_s", "placed_s", "allocated_s", "read_done_s", "first_token_s")
    names = ("schedule_s", "allocate_s", "read_s", "prefill_s")
    breakdown = {
        name: _mean(_column(records, b) - _column(records, a))
        for name, a, b in zip(names, stages[:-1], stages[1:], strict=True)
    }
    prompt, hit = _column(records, "prompt_tokens"), _column(records, "hit_tokens")
    return {
        "requests": int(records.shape[0]),
        "ttft_s": distribution((first - arrival).tolist()),
        "ttst_s": distribution([v for v in (second - first).tolist() if math.isfinite(v)]),
        "tpot_s": distribution([v for v in tpot.tolist() if math.isfinite(v)]),
        "ttft_breakdown_s": breakdown,
        "hit_rate": float(hit.sum() / prompt.sum()),
        "prompt_tokens_mean": float(prompt.mean()),
    }


def jct_summary(run: RawRun) -> dict[str, Any]:
    arrivals = np.asarray(run.agent_arrival_s)
    finishes = np.asarray(run.agent_finish_s)
    done = np.isfinite(finishes)
    return {
        "all_agents_s": float(finishes.max()) if done.all() and done.size else None,
        "agents_finished": int(done.sum()),
        "agents": int(done.size),
        "per_agent_s": distribution((finishes[done] - arrivals[done]).tolist()),
    }


def balance_summary(run: RawRun, setup: SimSetup) -> dict[str, Any]:
    config = setup.config
    report = storage_balance(
        run.storage_samples,
        config.balance_window_s,
        nodes=range(setup.num_nodes),
        min_load_fraction=config.balance_min_load,
    )
    ratios = [r for _, r in run.attention_balance]
    return {
        "storage_max_over_avg": report.mean_ratio,
        "storage_max_over_avg_worst": report.max_ratio,
        "storage_windows": len(report.ratios),
        "attention_max_over_avg": float(np.mean(ratios)) if ratios else None,
    }


def _per_instance(
    counter: dict[int, float], keys: range, duration_s: float, capacity: float
) -> dict[str, Any]:
    rates = [counter.get(k, 0.0) / duration_s for k in keys] if duration_s > 0 else [0.0]
    return {
        "total_bytes": float(sum(counter.get(k, 0.0) for k in keys)),
        "mean_bytes_per_s": float(np.mean(rates)),
        "max_bytes_per_s": float(max(rates)),
        "max_utilization": float(max(rates) / capacity),
    }


def traffic_summary(run: RawRun, setup: SimSetup) -> dict[str, Any]:
    """Mean rate per link instance over the run, its busiest instance, and the analysis' expectation."""
    t = run.traffic
    duration = run.end_s
    p, d = setup.num_prefill_nodes, setup.num_decode_nodes
    g, cnic = setup.gpus_per_node, setup.cnic_bytes_per_s
    snic = setup.config.storage_ratio * cnic
    read = dict(enumerate(run.snic_read_bytes))
    write = dict(enumerate(run.snic_write_bytes))
    links = {
        "pe_snic_read": _per_instance(read, range(p), duration, snic),
        "de_snic_read": _per_instance(read, range(p, p + d), duration, snic),
        "de_snic_write": _per_instance(write, range(p, p + d), duration, snic),
        "pe_cnic_read": _per_instance(t.pe_cnic_read, range(p * g), duration, cnic),
        "pe_cnic_write": _per_instance(t.pe_cnic_write, range(p * g), duration, cnic),
        "de_cnic_read": _per_instance(t.de_cnic_read, range(d * g), duration, cnic),
        "de_cnic_write": _per_instance(t.de_cnic_write, range(d * g), duration, cnic),
        "pe_dram": _per_instance(t.dram, range(p), duration, setup.dram_bytes_per_s),
        "de_dram": _per_instance(t.dram, range(p, p + d), duration, setup.dram_bytes_per_s),
    }
    rate = (lambda b: b / duration) if duration > 0 else (lambda b: 0.0)
    expected = expected_link_rates(p, d, g, rate(t.hit_bytes_by_side["pe"]), rate(t.hit_bytes_by_side["de"]))
    low, high = bottleneck_free_range(g, setup.config.storage_ratio, cnic, setup.dram_bytes_per_s)
    total_hit = t.hit_bytes_by_side["pe"] + t.hit_bytes_by_side["de"]
    return {
        "links": links,
        "expected_from_analysis": {name: getattr(expected, name) for name in expected.__slots__},
        "network_bytes": t.network_bytes,
        "de_read_share": t.hit_bytes_by_side["de"] / total_hit if total_hit else 0.0,
        "bottleneck_free_pd": [low, high],
        "pd_in_range": low <= p / d <= high,
    }


def summarize(run: RawRun, setup: SimSetup) -> dict[str, Any]:
    config = setup.config
    records = np.asarray(run.records, dtype=np.float64).reshape(-1, len(RECORD_FIELDS))
    cost = run.scheduler
    result: dict[str, Any] = {
        "setup": {
            "model": setup.model.name,
            "config": setup.pd_label,
            "policy": config.policy,
            "mode": config.mode,
            "layerwise": setup.is_layerwise,
            "oracle": config.oracle,
            "mal": config.mal,
            "agents": len(run.agent_arrival_s),
            "aps": config.aps if config.mode == "online" else None,
            "seed": config.seed,
        },
        "jct": jct_summary(run),
        "latency": latency_summary(records, config.warmup_s if config.mode == "online" else 0.0),
        "balance": balance_summary(run, setup),
        "traffic": traffic_summary(run, setup),
        "scheduler": {
            "rounds": cost.num_rounds,
            "placed": cost.num_placed,
            "cpu_s": cost.seconds,
            "us_per_placement": 1e6 * cost.seconds / cost.num_placed if cost.num_placed else None,
            "max_round_ms": 1e3 * cost.max_round_s,
            "cores_at_sim_speed": cost.seconds / run.end_s if run.end_s > 0 else None,
            "max_queue": cost.max_queue,
            "waiting_at_end": run.num_waiting,
            "oldest_waiting_s": run.oldest_waiting_s,
        },
        "sim": {
            "end_s": run.end_s,
            "events": run.num_events,
            "wall_s": run.wall_s,
            "requests": len(run.records),
        },
    }
    if config.mode == "online":
        window_lo = max(config.warmup_s, run.end_s - config.report_window_s)
        result["latency_last_window"] = latency_summary(records, window_lo)
    return result

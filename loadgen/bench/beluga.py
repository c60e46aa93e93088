"""`kvpath bench beluga`: Beluga's shared KV pool against what people run today, measured in one run.

Parts (`--parts`, all by default), each printed as a table:
  rpc    LOOKUP of 1 and 64 hashes over CXL-RPC (shared memory) vs NATS request/reply, same pool handler,
         1 and 8 clients: RTT p50/p99, ops/s; and the CPU of an idle pool server (beluga_rpc.py)
  load   the same hit blocks into an engine's cache from the pool, the remote store (tcp), storage files,
         against memcpy, at each block size (beluga_load.py)
  serve  serving, LV-Eval-like: populate, then the cache-hit run as an open-loop rate sweep (TTFT, KV-load
         stage) and a closed-loop peak (QPS), `kvpath up --kv-tier pool` vs `--kv-tier remote`
         (beluga_serve.py)
  sim    the paper's 2-server x 8-GPU experiment in the simulator with its hardware figures
         (`kvpath loadgen sim --sweep beluga`)
`--json FILE` writes every number, with the headline keys at the top level (TTFT and KV-load ratios over
every request of the rate sweep, QPS from the peak run): rpc_rtt_p50_us, nats_rtt_p50_us,
rpc_speedup, rpc_idle_cpu_percent, pool_load_gbps (re-load of verified blocks), pool_cold_gbps (first load:
every block hashed), pool_noverify_gbps, memcpy_gbps, pool_load_ratio, pool_cold_ratio,
remote_load_gbps, storage_load_gbps, kv_load_speedup, ttft_speedup, ttft_p99_speedup, qps_speedup,
sim_ttft_reduction, sim_qps_speedup.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

PARTS = ("rpc", "load", "serve", "sim")
_HEADLINE_BLOCK_SIZE = 128  # `tiny` at 128 tokens: 64 KiB Layer Blocks, the size the target names


def register(subparsers: argparse._SubParsersAction) -> None:
    from loadgen.bench.beluga_serve import ServeOptions

    d = ServeOptions()
    p = subparsers.add_parser("beluga", help="Beluga KV pool vs remote pool and NATS")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts, of {','.join(PARTS)}")
    p.add_argument("--rpc-duration", type=float, default=2.0, help="seconds per RPC measurement")
    p.add_argument("--load-block-sizes", default="64,128,256", help="block sizes (tokens) of the load part")
    p.add_argument("--load-mib", type=int, default=64, help="MiB of KV per load")
    p.add_argument("--load-repeats", type=int, default=7, help="timed loads per source (median reported)")
    p.add_argument(
        "--load-device",
        default="cpu",
        help="the cache the load part fills: cpu, cuda (layer by layer, as a GPU engine imports), auto",
    )
    p.add_argument("--model", default=d.model, help="serving: the model (smollm2, tiny, a checkpoint)")
    p.add_argument("--docs", type=int, default=d.docs, help="serving: shared documents")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens, help="serving: tokens per document")
    p.add_argument("--question-tokens", type=int, default=d.question_tokens, help="serving: per question")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="serving: tokens per answer")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="serving: sweep req/s")
    p.add_argument("--rate-duration", type=float, default=d.rate_duration_s, help="serving: s per rate")
    p.add_argument("--clients", type=int, default=d.clients, help="serving: closed-loop clients (peak)")
    p.add_argument("--duration", type=float, default=d.duration_s, help="serving: seconds of the peak run")
    p.add_argument("--zipf", type=float, default=d.zipf, help="serving: document popularity exponent")
    p.add_argument("--engines", type=int, default=d.engines, help="serving: colocated engines")
    p.add_argument(
        "--remote-cache-bytes",
        type=int,
        default=d.remote_cache_bytes,
        help="serving: a baseline engine's local DRAM cache (0: a sixth of the documents' KV)",
    )
    p.add_argument(
        "--pool-bytes", type=int, default=d.pool_bytes, help="serving: pool and store (0: 1.5x documents' KV)"
    )
    p.add_argument(
        "--kv-cache-bytes", type=int, default=d.kv_cache_bytes, help="serving: engine KV cache (0: default)"
    )
    p.add_argument("--up-arg", action="append", default=[], help="extra `kvpath up` flag for both (repeat)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write every number here")
    p.add_argument("--work-dir", default="", help="keep the serving clusters' logs here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"kvpath bench beluga: unknown parts {unknown}; known: {', '.join(PARTS)}")
    out: dict[str, Any] = {}
    if "rpc" in parts:
        out["rpc"] = _rpc(args)
    if "load" in parts:
        out["load"] = _load(args)
    if "serve" in parts:
        out["serve"] = _serve(args)
    if "sim" in parts:
        out["sim"] = _sim(args)
    summary = headline(out)
    print("\nheadline")
    for key, value in summary.items():
        print(f"  {key:<24} {value:.3f}" if value is not None else f"  {key:<24} -")
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, **out, "config": _config(args)}, indent=2))
    return 0


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _rpc(args: argparse.Namespace) -> dict[str, Any]:
    from loadgen.bench.beluga_rpc import measure_idle_cpu, run_rpc_bench

    results = run_rpc_bench(duration_s=args.rpc_duration)
    idle = measure_idle_cpu()
    print(f"{'RPC LOOKUP':<12}{'clients':>8}{'hashes':>8}{'p50 us':>10}{'p99 us':>10}{'ops/s':>12}")
    for r in results:
        print(
            f"{r.transport:<12}{r.num_clients:>8}{r.num_hashes:>8}{r.p50_us:>10.1f}{r.p99_us:>10.1f}"
            f"{r.ops_per_s:>12.0f}"
        )
    print(f"idle pool server CPU: {idle:.2f}% of a core")
    return {"results": [r.as_dict() for r in results], "idle_cpu_percent": idle}


def _load(args: argparse.Namespace) -> dict[str, Any]:
    from gpu.model_spec import load_model_spec
    from loadgen.bench.beluga_load import MODEL, measure_kv_load

    spec = load_model_spec(MODEL)
    rows = []
    print(f"\n{'KV load':<15}{'block':>6}{'LB KiB':>8}{'MiB':>6}{'ms':>9}{'GB/s':>8}{'x memcpy':>10}")
    for block_size in [int(b) for b in args.load_block_sizes.split(",") if b.strip()]:
        full_block = spec.num_layers * block_size * spec.kv_bytes_per_token_layer("float32")
        num_blocks = max(1, (args.load_mib << 20) // full_block)
        for r in measure_kv_load(block_size, num_blocks, args.load_repeats, device=args.load_device):
            rows.append(r.as_dict())
            print(
                f"{r.source:<15}{r.block_size:>6}{r.layer_block_bytes // 1024:>8}{r.bytes_per_read >> 20:>6}"
                f"{r.median_s * 1e3:>9.2f}{r.gbps:>8.2f}{r.ratio_to_memcpy:>10.2f}"
            )
    return {"results": rows, "device": args.load_device}


def _serve(args: argparse.Namespace) -> dict[str, Any]:
    from loadgen.bench.beluga_serve import ServeOptions, run_serving

    opts = ServeOptions(
        model=args.model,
        engines=args.engines,
        docs=args.docs,
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        max_tokens=args.max_tokens,
        rates=tuple(float(r) for r in args.rates.split(",") if r.strip()),
        rate_duration_s=args.rate_duration,
        clients=args.clients,
        duration_s=args.duration,
        zipf=args.zipf,
        remote_cache_bytes=args.remote_cache_bytes,
        pool_bytes=args.pool_bytes,
        kv_cache_bytes=args.kv_cache_bytes,
        seed=args.seed,
        up_args=list(args.up_arg),
    )
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        results = run_serving(opts, work)
    print(
        f"\n{'serving, hit run':<18}{'phase':>10}{'req':>6}{'fail':>5}{'TTFT mean':>10}{'p99':>8}"
        f"{'KV load ms':>11}{'read':>7}{'import':>7}{'QPS':>7}{'cached':>8}"
    )
    for r in results:
        for ph in (*r.sweep, r.peak):
            print(
                f"{r.tier + ' (' + r.policy + ')':<18}{ph.phase:>10}{ph.requests:>6}{ph.failed:>5}"
                f"{ph.ttft_mean_s:>10.3f}{ph.ttft_p99_s:>8.3f}{ph.kv_load_mean_s * 1e3:>11.2f}"
                f"{ph.stages_mean_s['read'] * 1e3:>7.2f}{ph.stages_mean_s['import'] * 1e3:>7.2f}"
                f"{ph.qps:>7.2f}{ph.cached_share:>8.1%}"
            )
    return {"results": [r.as_dict() for r in results], "options": dataclasses.asdict(opts)}


def _sim(args: argparse.Namespace) -> dict[str, Any]:
    from loadgen.sim.pool.config import PoolSimConfig
    from loadgen.sim.pool.report import format_beluga
    from loadgen.sim.pool.sweep import beluga_sweep

    result = beluga_sweep(PoolSimConfig(seed=args.seed))
    print("\n" + format_beluga(result))
    return result


def headline(out: dict[str, Any]) -> dict[str, float | None]:
    """The top-level numbers of `--json` from the parts that ran (None where a part did not run)."""

    def rtt(transport: str) -> float | None:
        for r in out.get("rpc", {}).get("results", []):
            if (r["transport"], r["num_clients"], r["num_hashes"]) == (transport, 1, 1):
                return float(r["p50_us"])
        return None

    def load(source: str) -> float | None:
        for r in out.get("load", {}).get("results", []):
            if (r["source"], r["block_size"]) == (source, _HEADLINE_BLOCK_SIZE):
                return float(r["gbps"])
        return None

    serve = {r["tier"]: r for r in out.get("serve", {}).get("results", [])}

    def ratio(base: float | None, new: float | None) -> float | None:
        return base / new if base is not None and new else None

    def served(tier: str, key: str) -> float | None:
        return float(serve[tier][key]) if tier in serve else None

    def sweep(tier: str, key: str) -> float | None:
        return served(tier, "sweep_" + key)

    def peak(tier: str) -> float | None:
        return float(serve[tier]["peak"]["qps"]) if tier in serve else None

    sim = out.get("sim", {})
    return {
        "rpc_rtt_p50_us": rtt("shm"),
        "nats_rtt_p50_us": rtt("nats"),
        "rpc_speedup": ratio(rtt("nats"), rtt("shm")),
        "rpc_idle_cpu_percent": out.get("rpc", {}).get("idle_cpu_percent"),
        "pool_load_gbps": load("pool"),
        "pool_cold_gbps": load("pool-cold"),
        "pool_noverify_gbps": load("pool-noverify"),
        "memcpy_gbps": load("memcpy"),
        "pool_load_ratio": ratio(load("pool"), load("memcpy")),
        "pool_cold_ratio": ratio(load("pool-cold"), load("memcpy")),
        "remote_load_gbps": load("remote"),
        "storage_load_gbps": load("storage"),
        "kv_load_speedup": ratio(
            served("remote", "sweep_kv_load_mean_s"), served("pool", "sweep_kv_load_mean_s")
        ),
        "ttft_speedup": ratio(served("remote", "sweep_ttft_mean_s"), served("pool", "sweep_ttft_mean_s")),
        "ttft_p99_speedup": ratio(served("remote", "sweep_ttft_p99_s"), served("pool", "sweep_ttft_p99_s")),
        "qps_speedup": ratio(peak("pool"), peak("remote")),
        "sim_ttft_reduction": sim.get("sim_ttft_reduction"),
        "sim_qps_speedup": sim.get("sim_qps_speedup"),
    }

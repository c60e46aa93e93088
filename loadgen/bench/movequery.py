"""`kvpath bench movequery`: route vs fetch vs local for one held chunk, measured and predicted side by side.

Both ends run in this process on the real KV data plane (a holder and a requester `KvReceiver`, one
`KvSender`, over each backend of `--backends`), with the served model's shape (`--model`: its heads, query
row width, partial width, KV bytes per token and layer):
- route: one layer's exchange: the requester writes M_q query rows (tokens x heads) into the holder's region
  with a notice, the holder attends them over the chunk (`gpu/movequery_timing.HolderKernel`) and writes the
  packed (o, m, l) back with a notice, the requester merges it with its local partial; per (M_q, chunk);
- fetch: the requester asks (a notice), the holder writes the whole chunk (every layer), the requester
  splices it into a paged cache (one scatter); per chunk;
- local: the chunk recomputed by the model runtime; per chunk.
Times are the median of `--repeats` after one warm-up (a route point's backends alternate repeat by
repeat). The cost model (`services/policy/movequery.py`) is then calibrated on them (least squares,
weighted by 1/T: probe + bytes/BW + attention per row x key per fabric, fixed + bytes/BW for fetch,
c per token x layer for local), predictions printed next to measurements, the model's MAPE for M_q >= 64
rows and the crossovers printed; `--calibrate FILE` writes the profile the router reads
(`--movequery-profile`). `--fanin` adds the agentic fan-in on real processes (movequery_fanin.py),
once per requester cache size of `--fanin-kv-blocks` (0: the default cache; small: memory-bound);
`--profile FILE` skips the microbenchmark and prices auto with a profile measured before.
`--json FILE` carries `model_mape`, `merge_max_rel_err` and `fanin` (rows of {n, primitive, ttft_p50_s,
decode_tok_s, kv_bytes, peak_concurrent, makespan_s, kv_blocks}; empty without `--fanin`); `--png FILE`
plots measured against predicted times and the fan-in's TTFT per primitive against N (movequery_plot.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from services.policy.movequery import (
    Compute,
    CostProfile,
    Fabric,
    ModelShape,
    fetch_s,
    local_fetch_crossover_tokens,
    local_s,
    route_exchange_s,
    route_fetch_crossover_rows,
)
from services.policy.movequery_profile import profile_to_dict

TIMEOUT_S = 30.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "movequery", help="move the query: route / fetch / local, measured vs model"
    )
    parser.add_argument(
        "--model", default="tiny", help="model of the exchanges' shapes and of the fan-in's engines"
    )
    parser.add_argument("--backends", default="shm,tcp", help="data-plane backends to measure")
    parser.add_argument("--query-tokens", default="1,2,8,32,128,256", help="query tokens per exchange")
    parser.add_argument("--chunks", default="256,1024,4096,8192", help="chunk lengths in tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    parser.add_argument("--calibrate", default="", help="write the calibrated cost profile to this file")
    parser.add_argument("--json", dest="json_path", default="", help="also write the results to this file")
    parser.add_argument("--fanin", action="store_true", help="also run the fan-in (real processes)")
    parser.add_argument("--fanin-ns", default="4,8,16,32", help="fan-in: concurrent sub-agents")
    parser.add_argument("--fanin-engines", type=int, default=2, help="fan-in: requester engines")
    parser.add_argument("--fanin-primitives", default="route,fetch,local,auto", help="fan-in: router modes")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="fan-in: the shared document's tokens")
    parser.add_argument(
        "--answer-tokens", type=int, default=16, help="fan-in: tokens each sub-agent generates"
    )
    parser.add_argument(
        "--fanin-kv-blocks",
        default="0",
        help="fan-in: requester cache sizes in blocks to run, comma-separated (0: the default cache; "
        "small: memory-bound, only a few document copies fit)",
    )
    parser.add_argument("--png", default="", help="plot: measured vs model, fan-in TTFT vs N (empty: none)")
    parser.add_argument(
        "--profile", default="", help="skip the microbenchmark; auto prices with this calibrated profile"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.profile:  # the fan-in alone, priced with a profile measured before
        report: dict[str, Any] = {"model": args.model, "model_mape": None, "merge_max_rel_err": None}
        report["fanin"] = _fanin(args, args.profile) if args.fanin else []
        return _write(args, report)
    report = _microbenchmark(args)
    with tempfile.TemporaryDirectory(prefix="kvpath-mq-") as tmp:
        profile_path = args.calibrate or os.path.join(tmp, "profile.json")
        with open(profile_path, "w") as f:
            json.dump(report["profile"] | {"model": args.model, "measured_at": time.time()}, f, indent=2)
        if args.fanin:
            report["fanin"] = _fanin(args, profile_path)
    return _write(args, report)


def _write(args: argparse.Namespace, report: dict[str, Any]) -> int:
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    if args.png:
        from loadgen.bench.movequery_plot import plot

        plot(report, args.png)
    return 0


def _microbenchmark(args: argparse.Namespace) -> dict[str, Any]:
    from gpu.movequery_timing import bench_shape, local_prefill_s, merge_max_rel_err
    from gpu.runner import ModelRunner

    runner = ModelRunner.load(args.model, device="cpu", block_size=64, num_kv_blocks=16)
    shape = bench_shape(runner)
    tokens = [int(t) for t in args.query_tokens.split(",") if t]
    chunks = [int(c) for c in args.chunks.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    measured = asyncio.run(_measure(shape, backends, tokens, chunks, args.repeats))
    measured["local"] = {c: local_prefill_s(runner, c) for c in chunks}
    runner.close()
    model_shape = ModelShape(
        num_layers=shape.num_layers,
        rows_per_token=shape.num_heads,
        query_bytes_per_row=shape.query_bytes_per_row,
        partial_bytes_per_row=shape.partial_bytes_per_row,
        kv_bytes_per_token_layer=shape.kv_bytes_per_token_layer,
    )
    profile = calibrate(model_shape, measured, backends)
    report = build_report(profile, measured, backends, merge_max_rel_err())
    report["model"] = args.model
    print(format_report(report))
    return report


def _fanin(args: argparse.Namespace, profile_path: str) -> list[dict[str, Any]]:
    from loadgen.bench.movequery_fanin import format_fanin, run_fanin

    rows = []
    for kv_blocks in [int(b) for b in args.fanin_kv_blocks.split(",") if b]:
        opts = {
            "primitives": [p for p in args.fanin_primitives.split(",") if p],
            "ns": [int(n) for n in args.fanin_ns.split(",") if n],
            "engines": args.fanin_engines,
            "model": args.model,
            "doc_tokens": args.doc_tokens,
            "max_tokens": args.answer_tokens,
            "kv_blocks": kv_blocks,
            "profile": profile_path,  # auto prices with the constants measured above
        }
        rows += run_fanin(opts)
    print(format_fanin(rows))
    return rows


# ------------------------------------------------------------------------------------------- measuring


async def _measure(
    shape: Any, backends: list[str], tokens: list[int], chunks: list[int], repeats: int
) -> dict[str, Any]:
    from shared.transport.config import TransportConfig
    from shared.transport.receiver import KvReceiver
    from shared.transport.sender import KvSender

    config = TransportConfig(backends=backends)
    holder, requester = KvReceiver(config, receiver_id="mq-holder"), KvReceiver(config, receiver_id="mq-req")
    sender = KvSender(config, sender_id="mq-bench")
    max_chunk_bytes = max(chunks) * shape.kv_bytes_per_token_layer * shape.num_layers
    max_rows = max(tokens) * shape.num_heads
    try:
        await holder.start()
        await requester.start()
        holder.register_region("q", max(64, max_rows * shape.query_bytes_per_row))
        requester.register_region("p", max(max_chunk_bytes, max_rows * shape.partial_bytes_per_row))
        ends: dict[str, tuple[Any, ...]] = {}
        for backend in backends:
            to_holder = await sender.connect(holder.endpoint(), timeout_s=TIMEOUT_S, backend=backend)
            to_requester = await sender.connect(requester.endpoint(), timeout_s=TIMEOUT_S, backend=backend)
            ends[backend] = (holder, requester, to_holder, to_requester)
        route = await _route_points(ends, shape, tokens, chunks, repeats)
        out: dict[str, Any] = {"route": route, "fetch": {}}
        for backend in backends:
            out["fetch"][backend] = {
                c: await _fetch_point(ends[backend], shape, c, repeats, max_chunk_bytes) for c in chunks
            }
        return out
    finally:
        await sender.close()
        await holder.close()
        await requester.close()


async def _route_points(
    ends: dict[str, tuple[Any, ...]], shape: Any, tokens: list[int], chunks: list[int], repeats: int
) -> dict[str, list[dict[str, Any]]]:
    """Every repeat sweeps every point (chunk, M_q, backend) once, and a point's figure is the median over
    the sweeps: a neighbour's burst on this shared machine then lands on one repeat of many points, which
    the median drops, instead of on every repeat of the few points measured during it. The first sweep warms
    up and is not counted."""
    from gpu.movequery_timing import HolderKernel, Merger, random_query

    kernels = {chunk: HolderKernel(shape, chunk) for chunk in chunks}
    mergers = {n: (Merger(shape, n), random_query(shape, n)) for n in tokens}
    times: dict[tuple[str, int, int], list[float]] = {}
    for sweep in range(repeats + 1):
        for chunk, kernel in kernels.items():
            for n, (merger, query) in mergers.items():
                for backend, backend_ends in ends.items():
                    elapsed = await _exchange(backend_ends, kernel, merger, query, n)
                    if sweep:
                        times.setdefault((backend, chunk, n), []).append(elapsed)
    return {
        backend: [
            {"rows": n * shape.num_heads, "chunk": chunk, "s": statistics.median(times[backend, chunk, n])}
            for chunk in chunks
            for n in tokens
        ]
        for backend in ends
    }


async def _exchange(ends: tuple[Any, ...], kernel: Any, merger: Any, query: np.ndarray, n: int) -> float:
    """One timed route exchange: query rows out, the holder's partial back, merged."""
    holder, requester, to_holder, to_requester = ends

    async def serve() -> None:
        notice = await holder.wait("q", 1, timeout_s=TIMEOUT_S)
        reply = kernel.answer(holder.region("q").view(0, notice.nbytes), n)
        await to_requester.write("p", 0, reply, tag=2, timeout_s=TIMEOUT_S)

    server = asyncio.create_task(serve())
    await asyncio.sleep(0)  # the holder waits for the notice before the clock starts
    started = time.perf_counter()
    await to_holder.write("q", 0, query, tag=1, timeout_s=TIMEOUT_S)
    notice = await requester.wait("p", 2, timeout_s=TIMEOUT_S)
    merger.merge(requester.region("p").view(0, notice.nbytes).view(np.float32))
    elapsed = time.perf_counter() - started
    await asyncio.wait_for(server, TIMEOUT_S)
    return elapsed


async def _fetch_point(ends: tuple[Any, ...], shape: Any, chunk: int, repeats: int, max_bytes: int) -> float:
    from gpu.movequery_timing import Splicer

    holder, requester, to_holder, to_requester = ends
    nbytes = chunk * shape.kv_bytes_per_token_layer * shape.num_layers
    block = 64 * shape.kv_bytes_per_token_layer * shape.num_layers
    nbytes = -(-nbytes // block) * block  # whole blocks, as storage and the cache hold them
    data = np.ones(min(nbytes, max_bytes), dtype=np.uint8)
    splicer = Splicer(shape, chunk, 64)

    async def serve(count: int) -> None:
        for _ in range(count):
            await holder.wait("q", 3, timeout_s=TIMEOUT_S)
            await to_requester.write("p", 0, data, tag=4, timeout_s=TIMEOUT_S)

    server = asyncio.create_task(serve(repeats + 1))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        await to_holder.write("q", 0, np.zeros(1, np.uint8), tag=3, timeout_s=TIMEOUT_S)
        notice = await requester.wait("p", 4, timeout_s=TIMEOUT_S)
        splicer.splice(requester.region("p").view(0, notice.nbytes))
        times.append(time.perf_counter() - started)
    await asyncio.wait_for(server, TIMEOUT_S)
    return statistics.median(times[1:])


# ------------------------------------------------------------------------------------------ calibrating


def _weighted_fit(columns: list[list[float]], target: list[float]) -> list[float]:
    """Least squares of target ~ columns, weighted by 1/target (relative error), coefficients >= 0."""
    a = np.array(columns, dtype=np.float64).T
    y = np.array(target, dtype=np.float64)
    w = 1.0 / y
    coef = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]
    return [max(0.0, float(c)) for c in coef]


def calibrate(shape: ModelShape, measured: dict[str, Any], backends: list[str]) -> CostProfile:
    # one joint fit: probe and byte rate per backend; the holder's attention per key (its KV read once per
    # call) and per row x key, shared by all
    columns: list[list[float]] = [[] for _ in range(2 * len(backends) + 2)]
    target = []
    for i, backend in enumerate(backends):
        for p in measured["route"][backend]:
            for j, column in enumerate(columns[:-2]):
                column.append((1.0 if j % 2 == 0 else float(p["rows"])) if j // 2 == i else 0.0)
            columns[-2].append(float(p["chunk"]))
            columns[-1].append(float(p["rows"] * p["chunk"]))
            target.append(p["s"])
    coef = _weighted_fit(columns, target)
    fabrics = {
        b: Fabric(b, coef[2 * i], shape.row_bytes / max(coef[2 * i + 1], 1e-15))
        for i, b in enumerate(backends)
    }
    fetch = measured["fetch"][backends[0]]
    chunk_bytes = [c * shape.kv_bytes_per_token_layer * shape.num_layers for c in fetch]
    fixed, per_byte = _weighted_fit([[1.0] * len(fetch), chunk_bytes], list(fetch.values()))
    local = measured["local"]
    (c,) = _weighted_fit([[t * shape.num_layers for t in local]], list(local.values()))
    compute = Compute(c, attention_s_per_key=coef[-2], attention_s_per_row_key=coef[-1])
    return CostProfile(shape, compute, fabrics, 1.0 / max(per_byte, 1e-15), fetch_fixed_s=fixed)


def build_report(
    profile: CostProfile, measured: dict[str, Any], backends: list[str], merge_err: float
) -> dict[str, Any]:
    route_rows, errors = [], []
    for backend in backends:
        fabric = profile.fabric(backend)
        for p in measured["route"][backend]:
            predicted = route_exchange_s(profile, fabric, p["rows"], p["chunk"])
            route_rows.append({"backend": backend, **p, "predicted_s": predicted})
            if p["rows"] >= 64:
                errors.append(abs(predicted - p["s"]) / p["s"])
    chunks = sorted(measured["local"])
    fetch_rows = [
        {
            "backend": b,
            "chunk": c,
            "s": measured["fetch"][b][c],
            "predicted_s": fetch_s(profile, c) if b == backends[0] else None,
        }
        for b in backends
        for c in chunks
    ]
    local_rows = [{"chunk": c, "s": measured["local"][c], "predicted_s": local_s(profile, c)} for c in chunks]
    crossovers = {
        "route_fetch_rows": {
            b: {str(c): route_fetch_crossover_rows(profile, profile.fabric(b), c) for c in chunks}
            for b in backends
        },
        "local_fetch_tokens": local_fetch_crossover_tokens(profile),
    }
    return {
        "model_mape": statistics.mean(errors) if errors else None,
        "merge_max_rel_err": merge_err,
        "route": route_rows,
        "fetch": fetch_rows,
        "local": local_rows,
        "crossovers": crossovers,
        "profile": profile_to_dict(profile),
        "fanin": [],
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        "route: one layer's exchange (query out, partial back, merge)",
        "backend   rows  chunk  meas ms  pred ms",
    ]
    for r in report["route"]:
        meas, pred = r["s"] * 1e3, r["predicted_s"] * 1e3
        lines.append(f"{r['backend']:<8}{r['rows']:>6}{r['chunk']:>7}{meas:>9.3f}{pred:>9.3f}")
    lines.append("fetch: whole chunk (every layer) pulled and spliced   |   local: chunk recomputed")
    for r in report["fetch"]:
        pred = "-" if r["predicted_s"] is None else f"{r['predicted_s'] * 1e3:.3f}"
        lines.append(f"fetch {r['backend']:<6} chunk {r['chunk']:>6}: {r['s'] * 1e3:9.3f} ms (model {pred})")
    for r in report["local"]:
        lines.append(
            f"local chunk {r['chunk']:>6}: {r['s'] * 1e3:9.3f} ms (model {r['predicted_s'] * 1e3:.3f})"
        )
    cross = report["crossovers"]
    for backend, per_chunk in cross["route_fetch_rows"].items():
        text = ", ".join(f"{c}: {v:.0f}" for c, v in per_chunk.items())
        lines.append(f"route/fetch crossover M_q rows by chunk ({backend}): {text}")
    lines.append(f"local/fetch crossover: {cross['local_fetch_tokens']:.0f} tokens")
    mape = report["model_mape"]
    lines.append(f"model MAPE (M_q >= 64 rows): {'-' if mape is None else f'{mape * 100:.1f}%'}")
    lines.append(f"LSE merge max error (fp32, of the largest value): {report['merge_max_rel_err']:.2e}")
    return "\n".join(lines)

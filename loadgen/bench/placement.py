"""`kvpath bench placement`: the live router's DualPath placement round at paper scale, without processes.

A real `EngineTable` and `PlacementQueue` (the router's own objects) over synthetic load reports:
--prefill-nodes and --decode-nodes nodes of --engines-per-node engines and one storage service each
(defaults: 48 + 96 nodes of 8, the paper's 1,152 GPUs). Before every round --reports-per-round random
services send a new load report (as between real rounds) and the queue is topped up to --waiting requests;
then one `PlacementQueue.round` is timed. Prints the median and p90 per policy, and a digest of every
decision: equal digests mean equal placements, so a change to the round's data structures can be checked
for the same decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import time
from pathlib import Path
from typing import Any

import orjson

from services.policy.snapshot import PendingRequest
from services.router.disaggregated import PlacementQueue, SchedulerParams
from services.router.engines import EngineTable
from shared.protocol import COMPUTE_RATE, PROMPT_RATE, KvFormat, LoadReport

FMT = KvFormat(fingerprint="bench-placement", block_size=64, bytes_per_token=4096)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("placement", help="the live router's placement round at paper scale")
    p.add_argument("--policies", default="dualpath,dualpath-rr,basic")
    p.add_argument("--prefill-nodes", type=int, default=48)
    p.add_argument("--decode-nodes", type=int, default=96)
    p.add_argument("--engines-per-node", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--reports-per-round", type=int, default=18)
    p.add_argument("--waiting", type=int, default=8, help="requests waiting at every round")
    p.add_argument(
        "--prefill-order",
        choices=("fcfs", "short-first"),
        default="fcfs",
        help="the queue's order; under short-first the PEs report their prefills' tokens left (past beta)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="also write the results to this file")
    p.set_defaults(func=_main)


def _report(sid: str, role: str, node: int, seq: int, rng: random.Random, order: str = "fcfs") -> LoadReport:
    if role == "storage":
        return LoadReport(
            service_id=sid, role=role, node=node, seq=seq, sent_at=0.0,
            read_queue_tokens=rng.randrange(0, 50_000), rates={"read_bandwidth_bytes_per_s": 5e9},
        )  # fmt: skip
    is_listed = order != "fcfs" and role == "prefill"
    left = sorted(rng.randrange(50, 8000) for _ in range(rng.randrange(0, 9))) if is_listed else []
    return LoadReport(
        service_id=sid, role=role, node=node, seq=seq, sent_at=0.0, num_running=rng.randrange(0, 8),
        unfinished_tokens=rng.randrange(0, 60_000), free_kv_blocks=rng.randrange(100, 4000),
        total_kv_blocks=4000, kv_format=FMT, prefill_order=order if is_listed else "",
        prefill_left_tokens=left, num_prefills=len(left),
        rates={PROMPT_RATE: 20_000.0, COMPUTE_RATE: 8_000.0},
    )  # fmt: skip


async def measure(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    table = EngineTable(silence_timeout_s=3600.0)
    services = []
    for node in range(args.prefill_nodes + args.decode_nodes):
        role = "prefill" if node < args.prefill_nodes else "decode"
        services += [(f"{role[0]}{node:03d}-{g}", role, node) for g in range(args.engines_per_node)]
        services.append((f"s{node:03d}", "storage", node))
    seqs = dict.fromkeys((sid for sid, _, _ in services), 1)
    for sid, role, node in services:
        table.update(_report(sid, role, node, 1, rng, args.prefill_order), time.monotonic())
    params = SchedulerParams(policy, alpha_s=1.0, beta_s=4.0, z_factor=1.2, prefill_order=args.prefill_order)
    queue = PlacementQueue(table, params)
    futures: dict[str, asyncio.Future[Any]] = {}
    times, placed, n, digest = [], 0, 0, hashlib.sha256()
    for _ in range(args.rounds):
        for sid, role, node in rng.sample(services, args.reports_per_round):
            seqs[sid] += 1
            table.update(_report(sid, role, node, seqs[sid], rng, args.prefill_order), time.monotonic())
        while len(futures) < args.waiting:
            n += 1
            request = PendingRequest(f"r{n}", rng.randrange(1000, 8000), rng.randrange(0, 1000), 9000)
            futures[request.request_id] = queue.enqueue(request)
        started = time.perf_counter()
        placed += queue.round()
        times.append(time.perf_counter() - started)
        for rid in [rid for rid, future in futures.items() if future.done()]:
            queue.queue.pop(rid)
            p = futures.pop(rid).result()
            queue.taken(p.pe_id, rid, accepted=True)  # as the dispatch does when the PE acks
            digest.update(
                repr((p.request_id, p.pe_id, p.de_id, p.read_side, p.read_node, p.read_tokens)).encode()
            )
    times.sort()
    return {
        "policy": policy,
        "engines": (args.prefill_nodes + args.decode_nodes) * args.engines_per_node,
        "rounds": len(times),
        "placed": placed,
        "round_p50_ms": statistics.median(times) * 1e3,
        "round_p90_ms": times[int(0.9 * len(times))] * 1e3,
        "decisions": digest.hexdigest()[:16],
    }


def _main(args: argparse.Namespace) -> int:
    rows = [asyncio.run(measure(p.strip(), args)) for p in args.policies.split(",") if p.strip()]
    for r in rows:
        print(
            f"{r['policy']:<12} round at {r['engines']:,} engines p50 {r['round_p50_ms']:.3f} ms"
            f"  p90 {r['round_p90_ms']:.3f} ms  ({r['placed']} placed in {r['rounds']} rounds;"
            f" decisions {r['decisions']})"
        )
    if args.json:
        Path(args.json).write_bytes(orjson.dumps({"results": rows}, option=orjson.OPT_INDENT_2))
    return 0

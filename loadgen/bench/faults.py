"""`kvpath bench faults`: every fault of issue 11 against real `kvpath up` clusters, and a soak, as a table.

Each row: the fault, what is expected, how the streams in flight ended (`ok`/`error`/`hung`), how many
requests the fault did not concern failed anyway, seconds until a new request is served again, and how many
stored blocks of a warm prompt no longer hit after recovery. The soak runs multi-turn sessions for a while and
prints each service's RSS at start and end and its growth over the last two-thirds (the issue: < 10%). The
short versions of these faults run in `make test` (tests/faults, tests/integration); this is the long one.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from loadgen.bench.fault_cases import CASES, Row, run_case
from loadgen.bench.soak import SoakResult, soak


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "faults", help="faults against kvpath up (kill, corrupt, garbage, soak): a table"
    )
    p.add_argument("--only", default="", help="comma-separated case names (default: all); 'none': soak only")
    p.add_argument("--soak-s", type=float, default=180.0, help="soak duration (0: no soak)")
    p.add_argument("--soak-clients", type=int, default=16, help="multi-turn sessions during the soak")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    wanted = {n for n in args.only.split(",") if n} if args.only else {name for name, _, _ in CASES}
    rows: list[Row] = []
    soaked: SoakResult | None = None
    with tempfile.TemporaryDirectory(prefix="kvpath-faults-") as tmp:
        for name, case, up_args in CASES:
            if name in wanted:
                started = time.monotonic()
                rows.append(await run_case(name, case, Path(tmp), up_args))
                print(
                    f"  {name}: {'pass' if rows[-1].passed else 'FAIL'} ({time.monotonic() - started:.0f} s)"
                )
        if args.soak_s > 0:
            soaked = await soak(Path(tmp) / "soak", args.soak_s, args.soak_clients)
    _print(rows, soaked)
    if args.json:
        _write_json(args.json, rows, soaked)
    ok = all(r.passed for r in rows) and (soaked is None or soaked.passed)
    return 0 if ok else 1


def _write_json(path: str, rows: list[Row], soaked: SoakResult | None) -> None:
    doc = {"rows": [asdict(r) for r in rows], "soak": asdict(soaked) if soaked else None}
    Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


def _print(rows: list[Row], soaked: SoakResult | None) -> None:
    print("\nfault | expectation | streams | others failed | recover s | blocks lost | result")
    print("---|---|---|---|---|---|---")
    for r in rows:
        streams = " ".join(f"{k}={v}" for k, v in sorted(r.streams.items())) or "-"
        result = "pass" if r.passed else "FAIL"
        note = f" ({r.note})" if r.note else ""
        print(f"{r.fault} | {r.expectation} | {streams} | {r.others_failed} | {r.recover_s:.2f} | "
              f"{r.blocks_lost} | {result}{note}")  # fmt: skip
    if soaked is None:
        return
    print(f"\nsoak: {soaked.clients} multi-turn sessions for {soaked.duration_s:.0f} s, {soaked.requests} "
          f"requests ({soaked.failed} failed), cached share {soaked.cached_share:.0%}")  # fmt: skip
    print("service | RSS start MiB | RSS at 1/3 MiB | RSS end MiB | growth over the last 2/3 | result")
    print("---|---|---|---|---|---")
    for name, (start, third, end) in sorted(soaked.rss_mib.items()):
        growth = (end - third) / third if third else 0.0
        result = "pass" if growth < 0.10 else "FAIL"
        print(f"{name} | {start:.0f} | {third:.0f} | {end:.0f} | {growth:+.1%} | {result}")

"""`kvpath bench model`: prefill and decode tokens/s of the model runtime next to transformers' generate.

The command: flags, the table and the JSON. The timing itself imports torch, so it lives in gpu/timing.py
(which says how runs are timed and compared) and is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from gpu.commands import add_runtime_args

if TYPE_CHECKING:
    from gpu.timing import TimingConfig, TimingRow


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("model", help="prefill/decode tokens/s next to transformers generate")
    parser.add_argument("--models", default="tiny,tiny-mla", help="comma-separated models")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (the best is reported)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this file")
    add_runtime_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpu.timing import TimingConfig, run_timings, set_torch_threads, torch_threads

    if args.threads:
        set_torch_threads(args.threads)
    config = TimingConfig(
        models=[m for m in args.models.split(",") if m],
        batch_sizes=[int(b) for b in args.batch_sizes.split(",") if b],
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        device=args.device,
        dtype=args.dtype,
        with_transformers=not args.no_transformers,
        cache_dir=args.cache_dir,
    )
    rows = run_timings(config)
    print(f"torch threads: {torch_threads()}, device: {config.device}, best of {config.repeats}")
    print(format_table(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(rows_json(rows, config, torch_threads()))
    return 0


def format_table(rows: list[TimingRow]) -> str:
    def num(value: float | None, fmt: str = ".0f") -> str:
        return "-" if value is None else format(value, fmt)

    header = (
        f"{'model':<10} {'batch':>5} {'prefill tok/s':>14} {'hf prefill':>11} "
        f"{'decode tok/s':>13} {'hf decode':>10} {'decode x':>9} {'x (cpu)':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.model:<10} {r.batch_size:>5} {num(r.prefill_tok_s):>14} {num(r.hf_prefill_tok_s):>11} "
            f"{num(r.decode_tok_s):>13} {num(r.hf_decode_tok_s):>10} {num(r.decode_speedup, '.2f'):>9} "
            f"{num(r.decode_speedup_cpu, '.2f'):>8}"
        )
    return "\n".join(lines)


def rows_json(rows: list[TimingRow], config: TimingConfig, torch_threads: int) -> str:
    payload = {
        "config": asdict(config),
        "torch_threads": torch_threads,
        "rows": [{**asdict(r), "decode_speedup": r.decode_speedup} for r in rows],
    }
    return json.dumps(payload, indent=2)

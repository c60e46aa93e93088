"""`kvpath loadgen sim`: one simulated run (a table, or `--json`), or an experiment with `--sweep`.

kvpath loadgen sim --model ds27b --config 1P1D --policy dualpath --agents 512 --mal 64k
kvpath loadgen sim --sweep fig8 --model ds27b --agents 1024 --mal 64k      # Basic vs DualPath, 3 P/D
kvpath loadgen sim --sweep ablation --model ds660b --agents 1024            # paper Figure 12 right
kvpath loadgen sim --sweep cost                                             # scheduler CPU at 48P96D
kvpath loadgen sim --sweep capacity --model ds660b --aps 0.2 --duration-s 900
kvpath loadgen sim --sweep beluga                                            # Beluga vs MoonCake, Table 5
kvpath loadgen sim --sweep auto                # every KV path, one cost model vs the fixed policies
kvpath loadgen sim --policy auto               # the `auto` policy alone on the same five workloads

`--sweep beluga` reads only its own flags (the PoolSimConfig group, YAML section `sim_pool:`) and `--seed`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import orjson

from loadgen.sim.config import SimConfig
from loadgen.sim.pool.config import PoolSimConfig
from shared.config import add_config_args, build_config
from shared.errors import KvpathError

SWEEPS = ("none", "fig8", "ablation", "cost", "capacity", "beluga", "movequery", "auto")
# --sweep cost without these flags: the paper's largest run, for a short simulated stretch
COST_DEFAULTS = {"model": "ds660b", "config": "48P96D", "agents": 49152, "max_sim_s": 600.0}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sim", help="simulate a DualPath cluster at paper scale (placement policies)")
    p.add_argument(
        "--sweep",
        choices=SWEEPS,
        default="none",
        help="run an experiment instead of one run (beluga reads --seed and the PoolSimConfig flags only)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="write the result as JSON to FILE (no FILE: print JSON instead of the table)",
    )
    p.add_argument("--config-file", default=None, help="YAML file (section `sim:`)")
    add_config_args(p, SimConfig)
    add_config_args(p, PoolSimConfig, skip=tuple(SimConfig.__dataclass_fields__))  # --sweep beluga
    p.set_defaults(func=_guarded(_run))


def _guarded(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except KvpathError as exc:
            print(f"kvpath loadgen sim: error: {exc.message}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"kvpath loadgen sim: error: {exc}", file=sys.stderr)
            return 2

    return run


def _config(args: argparse.Namespace) -> SimConfig:
    names = SimConfig.__dataclass_fields__
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if args.sweep == "cost":
        overrides = {**COST_DEFAULTS, **overrides}
    if args.sweep == "capacity":
        overrides = {"mode": "online", "aps": 0.1, **overrides}
    # shared.config binds its type variable to BaseConfig; SimConfig has its shape without the bus fields
    return build_config(  # type: ignore[type-var]
        SimConfig, section="sim", yaml_path=args.config_file, overrides=overrides
    )


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    from loadgen.sim import sweep
    from loadgen.sim.report import format_experiment
    from loadgen.sim.simulate import format_summary, simulate

    if args.sweep == "movequery":  # move the query: the paper's tables from the cost model (analytic)
        from loadgen.sim.movequery import format_movequery, movequery_sweep

        summary = movequery_sweep()
        return _emit(args, summary, format_movequery(summary))
    if args.sweep == "auto" or (args.sweep == "none" and getattr(args, "policy", None) == "auto"):  # issue 13
        from loadgen.sim.auto.cli import run_from_args

        return _emit(args, *run_from_args(args))
    if args.sweep == "beluga":
        from loadgen.sim.pool.report import format_beluga
        from loadgen.sim.pool.sweep import beluga_config, beluga_sweep

        summary = beluga_sweep(beluga_config(args), progress=_progress)
        return _emit(args, summary, format_beluga(summary))
    config = _config(args)
    result: dict[str, Any]
    if args.sweep == "none":
        result = simulate(config)
        text = format_summary(result)
    else:
        experiments: dict[str, Callable[..., dict[str, Any]]] = {
            "fig8": sweep.figure8,
            "ablation": sweep.ablation,
            "cost": sweep.scheduler_cost,
            "capacity": sweep.capacity,
        }
        result = experiments[args.sweep](config, progress=_progress)
        text = format_experiment(result)
    return _emit(args, result, text)


def _emit(args: argparse.Namespace, result: dict[str, Any], text: str) -> int:
    payload = orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    if args.json == "-":
        sys.stdout.write(payload.decode() + "\n")
        return 0
    if args.json:
        with open(args.json, "wb") as out:
            out.write(payload)
    print(text)
    return 0

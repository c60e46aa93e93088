"""The `kvpath` command.

  kvpath up ...                  local cluster: nats-server + every service as its own process
  kvpath serve <service> ...     one service (router, engine, storage, index) in the foreground
  kvpath generate ...            offline generation with the model runtime (smoke test of a checkpoint)
  kvpath loadgen ...             agentic trace synthesis, replay and reports
  kvpath bench <what> ...        benchmarks that print numbers

Subcommands register themselves from their own modules; heavy imports (torch) happen only when a
subcommand runs, so `kvpath --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# modules with `register(subparsers)` adding top-level subcommands
_COMMAND_MODULES = ("services.launcher", "gpu.commands", "loadgen.cli")
# modules with `register_bench(subparsers)` adding `kvpath bench <name>`
_BENCH_MODULES: tuple[str, ...] = (
    "gpu.commands",
    "shared.transport.bench",
    "services.storage.bench",
    "services.index.bench",
    "services.router.bench",
    "services.bench_dualpath",
    "services.bench_tracing",
)
# `kvpath serve <name>` runs `<module>.main(argv)`
SERVICE_MODULES = {
    "router": "services.router.__main__",
    "engine": "services.engine.__main__",
    "storage": "services.storage.__main__",
    "index": "services.index.__main__",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpath", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run one service in the foreground", add_help=False)
    serve.add_argument("service", choices=sorted(SERVICE_MODULES), help="which service")
    serve.set_defaults(func=_run_service)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    bench = sub.add_parser("bench", help="benchmarks (print numbers)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name in _BENCH_MODULES:
        importlib.import_module(name).register_bench(bench_sub)
    return parser


def _run_service(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(SERVICE_MODULES[args.service])
    return int(module.main(rest) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["serve"]:
        # everything after the service name belongs to that service's own parser
        args, _ = parser.parse_known_args(argv[:2])
        return _run_service(args, argv[2:])
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

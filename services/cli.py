"""The `kvpath` command.

  kvpath up ...                  local cluster: nats-server + every service as its own process
  kvpath serve [MODEL] ...       the same, in the shape of `vllm serve` (`--model X`, flags of `kvpath up`)
  kvpath serve <service> ...     one service (router, engine, storage, index) in the foreground
  kvpath generate ...            offline generation with the model runtime (smoke test of a checkpoint)
  kvpath loadgen ...             agentic trace synthesis, replay and reports
  kvpath bench <what> ...        benchmarks that print numbers
  kvpath profile ...             AMPD's cost model measured on this machine (T_pre, T_dec, T_kv)
  kvpath plan ...                AMPD's deployment planner (an ILP over simulated candidates)

This module registers the commands of its own floor and the ones below it (serve, up, generate). Packages
above services (loadgen) add theirs through the entry-point group `kvpath.commands` of the installed
distribution (pyproject.toml): each entry is a `register(subparsers)` function, so services never imports
them. Heavy imports (torch) happen only when a subcommand runs, so `kvpath --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points

from gpu.model_spec import EMBEDDED_MODELS, PACKAGED_MODELS
from shared.limits import raise_open_files_limit
from shared.version import kvpath_version

PLUGIN_GROUP = "kvpath.commands"
KNOWN_MODELS = (*PACKAGED_MODELS, *EMBEDDED_MODELS)
# `kvpath serve <name>` runs `<module>.main(argv)`
SERVICE_MODULES = {
    "router": "services.router.__main__",
    "engine": "services.engine.__main__",
    "storage": "services.storage.__main__",
    "index": "services.index.__main__",
    "remotekv": "services.remotekv.__main__",
    "cxlpool": "services.cxlpool.__main__",
}


def build_parser(*, with_plugins: bool = True) -> argparse.ArgumentParser:
    """The whole `kvpath` parser; `with_plugins=False` leaves out the commands of higher floors."""
    # imported here, not at the top: `kvpath serve <service>` never builds this parser, and these imports
    # (every routing policy among them) cost each index and storage process 45 ms of CPU to start
    from gpu import commands as gpu_commands
    from services.up import launcher

    parser = argparse.ArgumentParser(prog="kvpath", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"kvpath {kvpath_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="one service in the foreground, or (no service named) a local cluster serving a model",
        add_help=False,
    )
    serve.add_argument("service", choices=sorted(SERVICE_MODULES), help="which service")
    serve.set_defaults(func=_run_service)
    launcher.register(sub)
    gpu_commands.register(sub)
    if with_plugins:
        for plugin in plugin_commands():
            plugin.load()(sub)
    return parser


def _command_names(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


def plugin_commands() -> list[EntryPoint]:
    """The `kvpath.commands` entry points, by name; none means kvpath is not installed, which is an error."""
    found = sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name)
    if not found:
        raise SystemExit(
            f"kvpath: no commands registered in the entry-point group {PLUGIN_GROUP!r}; the kvpath package "
            "is not installed in this environment (run `make venv`, or `pip install -e .`)"
        )
    return found


def _run_service(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(SERVICE_MODULES[args.service])
    return int(module.main(rest) or 0)


SERVE_USAGE = f"""usage: kvpath serve <service> [flags]      one service in the foreground
       kvpath serve [MODEL] [flags of kvpath up]  a local cluster serving MODEL (as `vllm serve MODEL`)

services: {", ".join(sorted(SERVICE_MODULES))} (`kvpath serve <service> --help` lists its flags)
MODEL (or --model): a named model ({", ".join(KNOWN_MODELS)}), an HF checkpoint folder or a .gguf file;
the default is kvpath up's. The flags of `kvpath up` follow:
"""


def _serve(rest: list[str]) -> int:
    """`kvpath serve`: a named service, the help, or (vLLM's shape) the whole cluster for a model."""
    if rest[:1] in (["-h"], ["--help"]):
        print(SERVE_USAGE)
        return main(["up", "--help"])
    if rest and rest[0] in SERVICE_MODULES:
        # everything after the service name belongs to that service's own parser; a service starts
        # without importing the other commands
        return _run_service(argparse.Namespace(service=rest[0]), rest[1:])
    if rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0], *rest[1:]]
    return main(["up", *rest])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    raise_open_files_limit()  # for the command and the services it starts (they inherit it)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    # a command of this floor (`kvpath up`) parses without loading the higher floors' commands: their imports
    # (the load generator, the simulators) cost `kvpath up` a third of a second before it started anything
    parser = build_parser(with_plugins=False)
    if not argv or argv[0] not in _command_names(parser):
        parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

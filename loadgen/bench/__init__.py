"""`kvpath bench <what>`: benchmarks that print numbers, one module per command.

  serve      OpenAI streaming client against any server: tokens/s, TTFT, ITL      serve.py
  router     the router and the bus alone, engines replaced by load drivers        router.py (stack.py,
                                                                                   load_driver.py)
  dualpath   DualPath vs Basic vs round robin when storage is the bottleneck        dualpath.py
  tracing    serving throughput with tracing on vs off                             tracing.py
  storage    storage read throughput: service path vs raw file reads               storage.py
  index      index memory per block and prefix-match latency                       index.py
  placement  the live router's placement round at paper scale (no processes)         placement.py
  transport  KV data plane throughput: shm, tcp, plain socket                      transport.py
  model      model runtime tokens/s next to transformers (timing in gpu/timing.py)  model.py
  beluga     the KV pool vs a remote pool and NATS: RPC, KV load, serving, simulator beluga.py (beluga_rpc.py,
                                                                                   beluga_load.py,
                                                                                   beluga_serve.py)
  movequery  route vs fetch vs local for a held chunk, measured vs the cost model   movequery.py
  ampd       AMPD vs always-remote vs colocated: SLO attainment per trace           ampd.py
  auto       one cost model over every KV path vs the fixed policies (issue 13)     auto.py (auto_live*.py)
  agent      issue 12's done-when: tools, json_schema, logprobs (openai client)     agent.py

`register` is the `bench` entry of the `kvpath.commands` entry-point group (pyproject.toml). It imports the
bench modules only when called, so the processes some benches start with `python -m loadgen.bench.<module>`
(transport's receiver, router's load drivers) do not import the others.
"""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    """Add `kvpath bench` and one subcommand per bench module (each module's `register(subparsers)`)."""
    from loadgen.bench import (
        agent,
        ampd,
        auto,
        beluga,
        dualpath,
        faults,
        index,
        model,
        movequery,
        placement,
        router,
        serve,
        storage,
        tracing,
        transport,
    )

    bench = subparsers.add_parser("bench", help="benchmarks (print numbers)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module in (
        model,
        transport,
        storage,
        index,
        placement,
        serve,
        router,
        dualpath,
        beluga,
        tracing,
        ampd,
    ):
        module.register(bench_sub)
    faults.register(bench_sub)
    movequery.register(bench_sub)
    auto.register(bench_sub)
    agent.register(bench_sub)

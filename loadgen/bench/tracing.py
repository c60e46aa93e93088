"""`kvpath bench tracing` / `python -m loadgen.bench.tracing`: serving throughput, tracing on vs off.

Two local clusters (`kvpath up`, every service its own process) run side by side: one with tracing off, one
with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP/HTTP sink this process serves (it decodes every export
request and counts the spans, as a collector would, then answers like one). Each repetition runs `kvpath bench
serve` against both, in alternating order so that drift on a shared machine hits both alike. Two clusters on
one machine are not identical (an A/A run, `--aa`, shows the second one started running a few percent faster),
so the pair is restarted for every block with the start order swapped. The report gives every run and the
medians: output tokens/s, requests/s, TTFT, and the CPU time the cluster's processes (every service and its
nats-server; not the client, not the sink) spent per request, which a busy shared machine disturbs far less
than throughput. Issue 7's target: at most 5% throughput lost with tracing on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil
from aiohttp import web

from services.up.process import UpProcess

TARGET_LOSS = 0.05
MODES = ("off", "on")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("tracing", help="serving throughput with tracing on vs off (kvpath up x2)")
    add_args(p)
    p.set_defaults(func=run)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=2, help="cluster pairs started (start order swapped)")
    p.add_argument("--repeats", type=int, default=3, help="bench serve runs per mode and block")
    p.add_argument("--aa", action="store_true", help="calibration: neither cluster traces (noise floor)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (bench serve)")
    p.add_argument("--requests", type=int, default=48, help="requests per run (bench serve)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--shared-prefix-tokens", type=int, default=448, help="leading prompt tokens all share")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--up-arg", action="append", default=[], help="extra `kvpath up` flag for both (repeat)")
    p.add_argument("--json", default="", help="also write the results to this file")


# ------------------------------------------------------------------------------------------ OTLP sink


@dataclass(slots=True)
class OtlpSink:
    """Accepts OTLP/HTTP protobuf trace exports on POST /v1/traces and counts what arrives."""

    num_exports: int = 0
    num_spans: int = 0
    num_bytes: int = 0
    span_names: dict[str, int] = field(default_factory=dict)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = await request.read()
        export = ExportTraceServiceRequest.FromString(body)
        self.num_exports += 1
        self.num_bytes += len(body)
        for rs in export.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.num_spans += 1
                    self.span_names[s.name] = self.span_names.get(s.name, 0) + 1
        payload = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=payload, content_type="application/x-protobuf")


# --------------------------------------------------------------------------------------------- runs


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set (or, for "", remove) environment variables around starting a cluster; restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value:
                os.environ[key] = value
            else:
                os.environ.pop(key, None)
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def start_clusters(
    tmp: Path, sink_url: str, up_args: list[str], order: tuple[str, ...]
) -> dict[str, UpProcess]:
    """One cluster per mode, started in `order`; the `on` one exports to `sink_url` ("": no tracing)."""
    clusters: dict[str, UpProcess] = {}
    try:
        for mode in order:
            endpoint = sink_url if mode == "on" else ""
            (tmp / mode).mkdir(parents=True)
            with _env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, KVPATH_TRACE_DIR=""):
                clusters[mode] = UpProcess(tmp / mode, *up_args)
    except BaseException:
        for up in clusters.values():
            up.stop()
        raise
    return clusters


async def bench_serve(
    url: str, args: argparse.Namespace, json_path: Path, num_requests: int
) -> dict[str, Any]:
    """`kvpath bench serve` in a process of its own (as a client would be)."""
    cmd = [
        *("-m", "services.cli", "bench", "serve", "--url", url, "--quiet", "--json", str(json_path)),
        *("--concurrency", str(args.concurrency), "--requests", str(num_requests)),
        *("--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)),
        *("--shared-prefix-tokens", str(args.shared_prefix_tokens)),
    ]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *cmd, stdout=asyncio.subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), 600)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    try:
        data = await asyncio.to_thread(json_path.read_bytes)
    except FileNotFoundError:
        data = b""
    if proc.returncode != 0 or not data:
        raise RuntimeError(
            f"bench serve failed ({proc.returncode}): {output.decode(errors='replace')[-2000:]}"
        )
    out: dict[str, Any] = orjson.loads(data)
    return out


async def run_block(
    block: int, args: argparse.Namespace, sink_url: str, tmp: Path, runs: dict[str, list[dict]]
) -> None:
    """Start a cluster pair (odd blocks: the tracing one first), measure, stop it."""
    order = MODES if block % 2 == 0 else MODES[::-1]
    up_args = [part for flag in args.up_arg for part in flag.split()]
    endpoint = "" if args.aa else sink_url
    clusters = await asyncio.to_thread(start_clusters, tmp / f"block{block}", endpoint, up_args, order)
    try:
        await measure(block, clusters, args, tmp / f"block{block}", runs)
    finally:
        for up in clusters.values():  # on SIGINT the services flush their last spans to the sink
            await asyncio.to_thread(up.stop)


async def measure(
    block: int,
    clusters: dict[str, UpProcess],
    args: argparse.Namespace,
    tmp: Path,
    runs: dict[str, list[dict]],
) -> None:
    for mode, up in clusters.items():  # warm-up: model caches, connections, the first stored prefixes
        await bench_serve(up.url, args, tmp / f"warm-{mode}.json", max(2, args.concurrency))
    trees = {mode: _process_tree(up.proc.pid) for mode, up in clusters.items()}
    for rep in range(args.repeats):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            cpu_before = _cpu_by_kind(trees[mode])
            out = await bench_serve(clusters[mode].url, args, tmp / f"{mode}-{rep}.json", args.requests)
            cpu_after = _cpu_by_kind(trees[mode])
            row = _row(out)
            for kind, seconds in cpu_after.items():
                row[f"cpu_{kind}_ms"] = 1e3 * (seconds - cpu_before.get(kind, 0.0)) / args.requests
            row["cpu_ms_per_request"] = sum(v for k, v in row.items() if k.startswith("cpu_"))
            runs[mode].append(row)
            print(
                f"  block {block} rep {rep} tracing {mode:<3}: {row['output_tokens_per_s']:8.1f} tokens/s  "
                f"{row['requests_per_s']:6.2f} req/s  TTFT p50 {row['ttft_p50_ms']:7.1f} ms  "
                f"cluster CPU {row['cpu_ms_per_request']:6.1f} ms/request",
                flush=True,
            )


def _process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _cpu_by_kind(procs: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds (user + system) by process kind: router, engine, storage, index, nats, up."""
    out: dict[str, float] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            cmd = proc.cmdline()
            kind = cmd[cmd.index("serve") + 1] if "serve" in cmd[:-1] else ("up" if "up" in cmd else "nats")
            times = proc.cpu_times()
            out[kind] = out.get(kind, 0.0) + times.user + times.system
    return out


def _row(out: dict[str, Any]) -> dict[str, float]:
    return {
        "output_tokens_per_s": float(out["output_tokens_per_s"]),
        "requests_per_s": float(out["requests_per_s"]),
        "ttft_p50_ms": float(out["ttft_ms"]["p50"]),
        "itl_p50_ms": float(out["itl_ms"]["p50"]),
        "num_failed": float(out["num_failed"]),
    }


def summarize(runs: dict[str, list[dict]], sink: OtlpSink, args: argparse.Namespace) -> dict[str, Any]:
    medians = {
        mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for mode, rows in runs.items()
    }
    off, on = medians["off"]["output_tokens_per_s"], medians["on"]["output_tokens_per_s"]
    loss = (off - on) / off if off > 0 else 0.0
    # each repetition ran both modes back to back: the loss within a pair is free of slower drift
    cpu_off, cpu_on = medians["off"]["cpu_ms_per_request"], medians["on"]["cpu_ms_per_request"]
    paired = [
        (a["output_tokens_per_s"] - b["output_tokens_per_s"]) / a["output_tokens_per_s"]
        for a, b in zip(runs["off"], runs["on"], strict=True)
        if a["output_tokens_per_s"] > 0
    ]
    num_traced = args.blocks * (args.repeats * args.requests + max(2, args.concurrency))
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "runs": runs,
        "medians": medians,
        "throughput_loss": loss,
        "paired_losses": paired,
        "paired_loss_median": statistics.median(paired) if paired else 0.0,
        "cpu_overhead": (cpu_on - cpu_off) / cpu_off if cpu_off > 0 else 0.0,
        "meets_target": loss <= TARGET_LOSS,
        "sink": {
            "exports": sink.num_exports,
            "spans": sink.num_spans,
            "bytes": sink.num_bytes,
            "spans_per_request": sink.num_spans / num_traced,
            "span_names": dict(sorted(sink.span_names.items())),
        },
    }


def format_summary(result: dict[str, Any]) -> str:
    med, sink = result["medians"], result["sink"]
    config = result["config"]
    runs_per_mode = config["blocks"] * config["repeats"]
    calibration = " (A/A calibration: neither cluster traces)" if config["aa"] else ""
    lines = [f"bench tracing: medians of {runs_per_mode} runs per mode{calibration}"]
    for mode in MODES:
        m = med[mode]
        lines.append(
            f"  tracing {mode:<3}: {m['output_tokens_per_s']:8.1f} tokens/s  "
            f"{m['requests_per_s']:6.2f} req/s  TTFT p50 {m['ttft_p50_ms']:7.1f} ms  "
            f"ITL p50 {m['itl_p50_ms']:6.2f} ms  cluster CPU {m['cpu_ms_per_request']:6.1f} ms/request"
        )
    verdict = "within" if result["meets_target"] else "above"
    lines.append(
        f"  throughput lost with tracing on: {100 * result['throughput_loss']:.1f}% "
        f"({verdict} the {100 * TARGET_LOSS:.0f}% target); median of the per-repetition losses "
        f"{100 * result['paired_loss_median']:.1f}%"
    )
    lines.append(f"  cluster CPU per request with tracing on: {100 * result['cpu_overhead']:+.1f}%")
    kinds = sorted(k[4:-3] for k in med["off"] if k.startswith("cpu_") and k.endswith("_ms"))
    by_kind = ", ".join(f"{k} {med['off'][f'cpu_{k}_ms']:.1f}->{med['on'][f'cpu_{k}_ms']:.1f}" for k in kinds)
    lines.append(f"  CPU ms/request by process, off->on (medians): {by_kind}")
    lines.append(
        f"  OTLP sink: {sink['spans']} spans in {sink['exports']} exports ({sink['bytes'] / 1e6:.1f} MB), "
        f"{sink['spans_per_request']:.1f} spans per request"
    )
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    sink = OtlpSink()
    await sink.start()
    tmp = Path(tempfile.mkdtemp(prefix="kvpath-bench-tracing-"))
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        for block in range(args.blocks):
            await run_block(block, args, sink.url, tmp, runs)
    finally:
        await sink.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(runs, sink, args)


def run(args: argparse.Namespace) -> int:
    if min(args.blocks, args.repeats, args.requests, args.concurrency) < 1:
        print("kvpath bench tracing: blocks, repeats, requests and concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_run(args))
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"kvpath bench tracing: {exc}", file=sys.stderr)
        return 1
    print(format_summary(result), flush=True)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    failed = sum(r["num_failed"] for rows in result["runs"].values() for r in rows)
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpath bench tracing", description=__doc__.split("\n\n")[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`kvpath bench tracing` / `python -m services.bench_tracing`: serving throughput, tracing on vs off.

Two local clusters (`kvpath up`, every service its own process) run side by side for the whole benchmark: one
with tracing off, one with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP/HTTP sink this process serves
(it decodes every export request and counts the spans, as a collector would, then answers like one). Each
repetition runs `kvpath bench serve` against both, in alternating order so that drift on a shared machine
hits both alike, and the report gives per-repetition numbers and medians: output tokens/s, requests/s, TTFT.
Issue 7's target: at most 5% throughput lost with tracing on.
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
from aiohttp import web

from services.up_process import UpProcess

TARGET_LOSS = 0.05
MODES = ("off", "on")


def register_bench(subparsers: Any) -> None:
    p = subparsers.add_parser("tracing", help="serving throughput with tracing on vs off (kvpath up x2)")
    add_args(p)
    p.set_defaults(func=run)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5, help="bench serve runs per mode")
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


def start_clusters(tmp: Path, sink_url: str, up_args: list[str]) -> dict[str, UpProcess]:
    clusters: dict[str, UpProcess] = {}
    try:
        for mode in MODES:
            endpoint = sink_url if mode == "on" else ""
            (tmp / mode).mkdir()
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


async def measure(
    clusters: dict[str, UpProcess], args: argparse.Namespace, tmp: Path
) -> dict[str, list[dict]]:
    for mode, up in clusters.items():  # warm-up: model caches, connections, the first stored prefixes
        await bench_serve(up.url, args, tmp / f"warm-{mode}.json", max(2, args.concurrency))
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for rep in range(args.repeats):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            out = await bench_serve(clusters[mode].url, args, tmp / f"{mode}-{rep}.json", args.requests)
            runs[mode].append(_row(out))
            print(
                f"  rep {rep} tracing {mode:<3}: {out['output_tokens_per_s']:8.1f} tokens/s  "
                f"{out['requests_per_s']:6.2f} req/s  TTFT p50 {out['ttft_ms']['p50']:7.1f} ms",
                flush=True,
            )
    return runs


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
    paired = [
        (a["output_tokens_per_s"] - b["output_tokens_per_s"]) / a["output_tokens_per_s"]
        for a, b in zip(runs["off"], runs["on"], strict=True)
        if a["output_tokens_per_s"] > 0
    ]
    num_traced = (args.repeats * args.requests) + max(2, args.concurrency)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "runs": runs,
        "medians": medians,
        "throughput_loss": loss,
        "paired_losses": paired,
        "paired_loss_median": statistics.median(paired) if paired else 0.0,
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
    lines = [f"bench tracing: medians of {result['config']['repeats']} runs per mode"]
    for mode in MODES:
        m = med[mode]
        lines.append(
            f"  tracing {mode:<3}: {m['output_tokens_per_s']:8.1f} tokens/s  "
            f"{m['requests_per_s']:6.2f} req/s  TTFT p50 {m['ttft_p50_ms']:7.1f} ms  "
            f"ITL p50 {m['itl_p50_ms']:6.2f} ms"
        )
    verdict = "within" if result["meets_target"] else "above"
    lines.append(
        f"  throughput lost with tracing on: {100 * result['throughput_loss']:.1f}% "
        f"({verdict} the {100 * TARGET_LOSS:.0f}% target); median of the per-repetition losses "
        f"{100 * result['paired_loss_median']:.1f}%"
    )
    lines.append(
        f"  OTLP sink: {sink['spans']} spans in {sink['exports']} exports ({sink['bytes'] / 1e6:.1f} MB), "
        f"{sink['spans_per_request']:.1f} spans per request"
    )
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    sink = OtlpSink()
    await sink.start()
    tmp = Path(tempfile.mkdtemp(prefix="kvpath-bench-tracing-"))
    clusters: dict[str, UpProcess] = {}
    try:
        clusters = await asyncio.to_thread(
            start_clusters, tmp, sink.url, [p for a in args.up_arg for p in a.split()]
        )
        runs = await measure(clusters, args, tmp)
    finally:
        for up in clusters.values():  # on SIGINT the services flush their last spans to the sink
            await asyncio.to_thread(up.stop)
        await sink.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(runs, sink, args)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.requests < 1 or args.concurrency < 1:
        print("kvpath bench tracing: repeats, requests and concurrency must be >= 1", file=sys.stderr)
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

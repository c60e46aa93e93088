"""`kvpath bench router` (and `kvpath bench serve` through it): the load driver's wire format, CPU sampling,
and both commands against real processes (nats-server, `kvpath serve router`, load-driver engines)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from loadgen.bench.load_driver import DriverStream, StepEncoder
from loadgen.bench.serve import ServeBenchConfig, run_serve_bench
from loadgen.bench.stack import BenchStack, CpuSampler, RouterBenchOptions
from shared.protocol import TokenBatch, decode

# ------------------------------------------------------------------------------------------ pure parts


def test_step_encoder_emits_valid_token_batches_per_router() -> None:
    enc = StepEncoder("drv-0", [97, 98])
    streams = [
        DriverStream("a", "router-1", num_prompt_tokens=7, max_tokens=2),
        DriverStream("b", "router-2", num_prompt_tokens=3, max_tokens=5),
    ]
    first, finished = enc.step(streams, step=1)
    assert finished == [] and sorted(first) == ["router-1", "router-2"]
    batch = decode(first["router-1"], TokenBatch)  # the router's own validation accepts it
    assert batch.engine_id == "drv-0" and batch.step == 1
    (delta,) = batch.deltas
    assert (delta.request_id, delta.seq, delta.token_ids, delta.prompt_tokens) == ("a", 0, [97], 7)
    assert delta.finish_reason is None
    second, finished = enc.step(streams, step=2)
    assert finished == ["a"]
    last = decode(second["router-1"], TokenBatch).deltas[0]
    assert (last.seq, last.token_ids, last.finish_reason, last.prompt_tokens) == (1, [98], "length", 0)
    assert decode(second["router-2"], TokenBatch).deltas[0].finish_reason is None


def test_cpu_sampler_attributes_cpu_seconds_to_the_window() -> None:
    sampler = CpuSampler({"me": [os.getpid()]})
    sampler.sample()
    t0 = time.time()
    cpu_start = time.process_time()
    while time.process_time() - cpu_start < 0.1:  # burn 0.1 s of this process's CPU
        pass
    t1 = time.time()
    sampler.sample()
    used = sampler.seconds_between(t0, t1)["me"]
    assert 0.08 <= used <= (time.process_time() - cpu_start) + 0.03


# ------------------------------------------------------------------------- against real processes


@pytest.fixture(scope="module")
def bench_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchStack]:
    stack = BenchStack(str(tmp_path_factory.mktemp("bench")), RouterBenchOptions(engines=1, step_hz=200.0))
    try:
        stack.start()
        asyncio.run(stack.wait_ready())
        yield stack
    finally:
        stack.stop()


async def test_bench_serve_counts_exactly_through_the_router(bench_stack: BenchStack) -> None:
    cfg = ServeBenchConfig(url=bench_stack.url, concurrency=4, num_requests=6, prompt_tokens=8, max_tokens=12)
    out = await run_serve_bench(cfg)
    assert out["first_error"] == "" and out["num_ok"] == 6 and out["model"] == "tiny"
    assert out["output_tokens"] == 6 * 12 and out["output_tokens_per_s"] > 0
    assert out["tokens_per_chunk"] >= 1.0
    for key in ("ttft_ms", "itl_ms", "e2e_s"):
        assert out[key]["p50"] > 0 and out[key]["p99"] >= out[key]["p50"]
    assert out["finished_unix"] > out["started_unix"]


async def test_bench_serve_openai_only_uses_usage_totals(bench_stack: BenchStack) -> None:
    cfg = ServeBenchConfig(
        url=bench_stack.url, concurrency=2, num_requests=2, prompt_tokens=4, max_tokens=5, openai_only=True
    )
    out = await run_serve_bench(cfg)
    assert out["num_ok"] == 2 and out["output_tokens"] == 10  # the driver ignores EOS anyway


async def test_bench_serve_reports_refused_requests(bench_stack: BenchStack) -> None:
    cfg = ServeBenchConfig(url=bench_stack.url, model="no-such-model", concurrency=2, num_requests=3)
    out = await run_serve_bench(cfg)
    assert out["num_ok"] == 0 and out["num_failed"] == 3
    assert out["first_error"].startswith("HTTP 404") and "no-such-model" in out["first_error"]


async def test_client_gone_frees_the_load_driver_slot(bench_stack: BenchStack) -> None:
    body = {"model": "tiny", "prompt": [65, 66], "max_tokens": 100_000 // 20, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{bench_stack.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # streaming has begun; now hang up
        deadline = time.monotonic() + 20
        while True:
            async with http.get(f"{bench_stack.engine_urls[0]}/health") as health:
                if (await health.json())["num_running"] == 0:
                    break
            assert time.monotonic() < deadline, "the aborted request still runs in the load driver"
            await asyncio.sleep(0.05)


def test_bench_router_command_prints_and_writes_its_fields(tmp_path: Path) -> None:
    out_path = tmp_path / "router.json"
    cmd = [sys.executable, "-m", "services.cli", "bench", "router", "--streams", "8"]
    # 1 s of streaming: the router's CPU over the run spans several of psutil's 10 ms ticks (20 tokens, 0.1 s,
    # once read as 0)
    cmd += ["--tokens-per-stream", "200", "--engines", "1", "--step-hz", "200", "--json", str(out_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for label in ("streamed tokens/s", "router CPU", "CPU by process", "TTFT p50 / p99", "ITL  p50 / p99"):
        assert label in proc.stdout
    out = json.loads(out_path.read_text())
    assert out["client"]["num_ok"] == 8 and out["client"]["output_tokens"] == 8 * 200
    assert out["streamed_tokens_per_s"] > 0 and out["offered_tokens_per_s"] == 8 * 200
    assert set(out["cpu_percent"]) == {"router", "engines", "nats", "client"}
    assert out["router_cpu_percent"] > 0 and out["engine_steps"] >= 200

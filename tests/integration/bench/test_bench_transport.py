"""`kvpath bench transport` runs end to end and reports every backend and the socket baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.bench.transport_senders import parse_cpus

CPU = min(os.sched_getaffinity(0))  # one this process may use (a container may not offer CPU 0)


def test_bench_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "bench",
        "transport",
        "--sizes",
        "64K,1M",
        "--total-mib",
        "4",
        "--blocks-per-write",
        "2",
        "--json",
        str(out),
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=100, check=True, cwd=Path(__file__).resolve().parents[3]
    )
    assert "tcp/socket" in result.stdout and "64 KiB" in result.stdout and "1 MiB" in result.stdout
    doc = json.loads(out.read_text())
    assert "fixed cost" not in result.stdout and "fixed_cost_us" not in doc  # 4 in flight: no per-write cost
    rows = doc["results"]
    assert [r["size_bytes"] for r in rows] == [64 << 10, 1 << 20]
    for row in rows:
        assert row["blocks_per_write"] == 2 and row["messages"] % 2 == 0
        assert all(row[k] > 0 for k in ("shm", "tcp", "socket"))


def test_a_neighbor_runs_beside_both_ends_and_repeats_keep_every_run(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "services.cli", "bench", "transport", "--sizes", "16K,64K",
           "--total-mib", "2", "--window", "1", "--backends", "shm", "--neighbor", "--repeats", "2",
           "--cpus", str(CPU), "--json", str(out)]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=100, check=True, cwd=Path(__file__).resolve().parents[3]
    )
    assert "neighbor (a CPU-bound process beside both ends)" in result.stdout
    assert "fixed cost per write call, shm:" in result.stdout  # one write in flight: the fixed cost
    doc = json.loads(out.read_text())
    assert doc["neighbor_iterations_per_s"] > 1e5 and doc["results"][0]["shm"] > 0
    assert len(doc["runs"]) == 2 and len(doc["fixed_cost_us_runs"]["shm"]) == 2  # --repeats: each run kept
    assert "fixed cost per write call, shm, each run:" in result.stdout
    assert doc["cpus"] == {"receiver": [CPU], "sender": [CPU]}  # where each end ran, as the kernel says


def test_several_senders_stream_into_one_receiver(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "services.cli", "bench", "transport", "--sizes", "16K,64K",
           "--total-mib", "2", "--senders", "2", "--cpus", str(CPU), "--json", str(out)]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=100, check=True, cwd=Path(__file__).resolve().parents[3]
    )
    assert "2 sender processes into one receiver" in result.stdout
    assert "lost" not in result.stderr  # the senders leave before the receiver closes
    doc = json.loads(out.read_text())
    assert doc["senders"] == 2 and [r["size_bytes"] for r in doc["results"]] == [16 << 10, 64 << 10]
    for row in doc["results"]:
        assert row["messages"] == (2 << 20) // row["size_bytes"] // 2  # per sender
        assert all(row[b] > 0 and row[f"{b}_us_per_write"] > 0 for b in ("shm", "tcp"))
        assert row["cpus"] == {"receiver": [CPU], "senders": [[CPU], [CPU]]}


def test_cpus_must_be_ones_this_process_may_use() -> None:
    assert parse_cpus(f"{CPU},{CPU}") == [CPU, CPU]
    for bad in ("", "a,b", "100000", f"{CPU},-1"):
        with pytest.raises(SystemExit, match="--cpus"):
            parse_cpus(bad)

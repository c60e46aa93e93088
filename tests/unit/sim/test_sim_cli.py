"""`kvpath loadgen sim`: a table, JSON, the sweeps' tables, and errors as one line with exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadgen.cli import main

TINY = ("--agents", "6", "--mal", "32k", "--storage-ratio", "0.05", "--tpot-s", "0.002")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["sim", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_one_run_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc, text, _ = run(
        capsys, "--model", "ds27b", "--config", "1P1D", "--policy", "dualpath", *TINY, "--json", str(out)
    )
    assert rc == 0
    assert "ds27b 1P1D dualpath, offline, 6 agents, MAL 32k" in text
    for label in ("JCT", "TTFT breakdown", "SNIC max/avg", "scheduler"):
        assert label in text
    result = orjson.loads(out.read_bytes())
    assert result["setup"]["config"] == "1P1D" and result["jct"]["agents_finished"] == 6
    assert set(result["latency"]["ttft_breakdown_s"]) == {"schedule_s", "allocate_s", "read_s", "prefill_s"}


def test_json_without_a_file_prints_json_only(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, _ = run(capsys, "--policy", "basic", "--config", "2P1D", *TINY, "--json")
    result = orjson.loads(text)
    assert rc == 0 and result["setup"]["policy"] == "basic" and result["traffic"]["de_read_share"] == 0


def test_fig8_sweep_prints_speedups_and_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, err = run(capsys, "--sweep", "fig8", *TINY)
    assert rc == 0
    assert "speedup mean" in text and "(paper 1.64x)" in text
    assert "dualpath 1P1D / basic 2P1D" in text
    assert err.count("JCT") == 6  # progress: one line per run


def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "--config", "2X3Y", *TINY)
    assert rc == 2 and err.strip() == (
        "kvpath loadgen sim: error: invalid config '2X3Y': expected xPyD with x, y >= 1, e.g. 1P1D"
    )
    rc, _, err = run(capsys, "--mode", "online", *TINY)
    assert rc == 2 and "online mode needs --aps > 0" in err
    rc, _, err = run(capsys, "--model", "ds27b", "--de-kv-gb", "0.5", *TINY)
    assert rc == 2 and "raise --de-kv-gb" in err


def test_registered_in_the_kvpath_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "loadgen", "sim", *TINY, "--mode", "online", "--aps", "0.05"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "online" in proc.stdout and "TTFT last window" in proc.stdout


def test_cost_sweep_times_the_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--sweep", "cost", "--config", "2P2D", "--agents", "64", "--mal", "32k", "--max-sim-s", "10")
    rc, text, _ = run(capsys, *argv, "--json", "-")
    result = orjson.loads(text)
    assert rc == 0 and result["config"] == "2P2D" and result["gpus"] == 32 and result["placements"] > 64
    assert result["simulated_s"] == 10.0 and 0 < result["place_cpu_s"] <= result["round_cpu_s"]
    assert result["cores"] == pytest.approx(result["round_cpu_s"] / 10.0)
    rc, text, _ = run(capsys, *argv)
    assert "Scheduler cost: 2P2D (32 GPUs), 64 agents" in text and "paper: under 10 cores" in text


def test_ablation_and_capacity_sweeps(capsys: pytest.CaptureFixture[str]) -> None:
    rc, text, _ = run(capsys, "--sweep", "ablation", *TINY)
    assert rc == 0 and "+scheduler (DualPath)" in text and "45.6%" in text
    online = ("--agents", "1", "--mal", "32k", "--storage-ratio", "0.02", "--tpot-s", "0.002")
    rc, text, _ = run(
        capsys, "--sweep", "capacity", *online, "--duration-s", "200", "--aps", "0.2", "--json", "-"
    )
    result = orjson.loads(text)
    assert rc == 0 and set(result["capacity"]) == {"basic", "dualpath"}
    for row in result["capacity"].values():
        assert 0 <= row["aps"] < row["first_failing_aps"]
    # both read paths beat one: DualPath sustains more agents per second than Basic on 1P1D
    assert result["ratio"] > 1

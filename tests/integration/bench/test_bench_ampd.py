"""`kvpath bench ampd`, small: `kvpath profile` runs first, three real clusters replay one trace, the
simulator runs at paper scale, and the JSON carries `attainment` and `sim_attainment` as
{trace: {policy: fraction}}."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
POLICIES = {"ampd", "disagg-remote", "colocated"}


@pytest.mark.timeout(300)
def test_bench_ampd_writes_live_and_simulated_attainment(tmp_path: Path) -> None:
    out = tmp_path / "ampd.json"
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "ampd", "--traces", "hotpotqa", "--sessions", "3",
        "--rate", "4", "--length-scale", "0.05", "--sim", "--json", str(out),
        "--work-dir", str(tmp_path / "w"),
    ]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=280, cwd=Path(__file__).resolve().parents[3]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["attainment"]) == {"hotpotqa"} and set(data["attainment"]["hotpotqa"]) == POLICIES
    assert set(data["sim_attainment"]) == {"hotpotqa"} and POLICIES <= set(data["sim_attainment"]["hotpotqa"])
    assert all(0 <= v <= 1 for v in data["attainment"]["hotpotqa"].values())
    runs = {r["policy"]: r for r in data["runs"]}
    assert all(r["failed"] == 0 and r["requests"] >= 3 for r in runs.values()), runs
    assert runs["colocated"]["local_share"] == 1.0 and runs["disagg-remote"]["local_share"] == 0.0
    assert (tmp_path / "w" / "profile.json").exists()

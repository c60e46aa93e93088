"""`kvpath bench auto --live`, small: the simulator's five workloads, then the live agent configurations on
real clusters, one per policy: `pd` (multi-turn agents on 1 prefill + 1 decode node: dualpath, ampd, auto)
and `fanin` (a pinned document and sub-agents on engines that move the query: route, fetch, auto). The JSON
keeps the simulator's `results` and `ttft_mdape` and carries the live rows with auto's decisions parsed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SIMULATED = {"dualpath", "ampd", "pool", "fanin", "mix"}
LIVE = {"pd": {"dualpath", "ampd", "auto"}, "fanin": {"route", "fetch", "auto"}}


@pytest.mark.timeout(420)
def test_bench_auto_live_runs_every_policy_on_pd_agents_and_the_fan_in(tmp_path: Path) -> None:
    out = tmp_path / "auto.json"
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "auto", "--live", "--live-configs", "pd,fanin",
        "--live-repeats", "1", "--pd-sessions", "2", "--pd-clients", "2", "--pd-first-tokens", "300",
        "--fanin-agents", "3", "--fanin-doc-tokens", "256", "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=400, cwd=Path(__file__).resolve().parents[3]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == SIMULATED and data["ttft_mdape"] is not None
    live = data["live"]
    assert {c: set(by) for c, by in live["results"].items()} == LIVE
    assert data["live_ttft_mdape"] == live["ttft_mdape"] is not None
    for config, rows in live["rows"].items():
        for policy, row in rows.items():
            assert row["failed"] == 0 and row["requests"] > 0, (config, policy, row)
    pd = live["rows"]["pd"]
    assert all(r["sessions"] == 2 and r["requests"] >= 8 for r in pd.values())  # 4-6 turns per session
    assert all(live["results"]["pd"][p] == r["mean_session_jct_s"] > 0 for p, r in pd.items())
    assert pd["auto"]["decisions"] == pd["auto"]["requests"] and pd["auto"]["ttft_mdape"] is not None
    assert set(pd["auto"]["plans"]) <= {
        f"{w}/{s}" for w in ("local", "remote") for s in ("hbm", "storage", "recompute")
    }
    fanin = live["rows"]["fanin"]
    assert all(r["requests"] == 3 and r["makespan_s"] > 0 for r in fanin.values())
    assert fanin["route"]["movequery_choices"] == {"route": 3} and fanin["fetch"]["movequery_choices"] == {
        "fetch": 3
    }
    assert fanin["auto"]["decisions"] == 3 and sum(fanin["auto"]["plans"].values()) == 3
    # the engines share this host's cores (one compute_id): auto leaves the holder to the requesters
    assert fanin["auto"]["on_holder"] == 0 and sum(fanin["auto"]["engines"].values()) == 3


def test_the_cli_default_names_every_live_configuration() -> None:
    from loadgen.bench.auto import LIVE_CONFIGS
    from loadgen.bench.auto_live import CONFIGS

    assert LIVE_CONFIGS.split(",") == list(CONFIGS)

"""The load generator against a real kvpath cluster (`kvpath up`: nats-server, router, engine, storage,
index).

A DualPath-like trace (Table 2 32K profile, lengths scaled for the CPU) replays offline through the `kvpath
loadgen replay` command: sane metrics, exact output lengths, and from turn 2 on a cached-token hit rate above
90%. A time- and length-scaled slice of the Mooncake conversation trace replays online at its own arrival
times.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import orjson
import pytest

from loadgen.result import load_result
from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")
VOCAB = "256"  # the tiny model's byte ids (its special tokens sit above 255)


@pytest.fixture(scope="module")
def cluster(kv_store_cluster: UpProcess) -> UpProcess:
    """`kvpath up --kv-root DIR`, shared with the KV-reuse tests (tests/conftest.py)."""
    return kv_store_cluster


def run_loadgen(*args: str, timeout_s: float = 100.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "loadgen", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def loadgen(*args: str, timeout_s: float = 100.0) -> str:
    proc = run_loadgen(*args, timeout_s=timeout_s)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def check_request_sanity(requests: list[dict[str, object]]) -> None:
    for r in requests:
        assert r["error"] is None and r["status"] == 200
        assert r["output_tokens"] == r["max_tokens"]  # ignore_eos + min_tokens give exact lengths
        assert r["prompt_tokens"] == r["client_prompt_tokens"]  # token-id prompts arrive unchanged
        assert 0 < r["ttft_s"] <= r["e2e_s"]  # type: ignore[operator]
        assert r["t_start_s"] < r["t_first_s"] <= r["t_last_token_s"] <= r["t_end_s"]  # type: ignore[operator]
        assert 0 <= r["cached_tokens"] <= r["ideal_cached_tokens"]  # type: ignore[operator]


def test_dualpath_trace_offline(cluster: UpProcess, tmp_path: Path) -> None:
    trace, out = tmp_path / "dualpath.jsonl", tmp_path / "dualpath.json"
    synth = "synth --profile dualpath-32k --agents 2 --seed 1 --length-scale 0.0625 --max-context 2048"
    loadgen(*synth.split(), "--out", str(trace))
    replay = f"replay --mode offline --vocab-size {VOCAB} --progress off --label kvpath-colocated"
    text = loadgen(
        *replay.split(),
        "--url",
        cluster.url,
        "--trace",
        str(trace),
        "--out",
        str(out),
        "--plot-dir",
        str(tmp_path / "p"),
    )
    assert "hit rate" in text
    result = load_result(out)
    s = result["summary"]
    assert result["meta"]["model"] == "tiny" and result["meta"]["stop_reason"] == "completed"
    assert s["requests"]["failed"] == 0 and s["requests"]["completed"] >= 60 and s["sessions"] == 2
    check_request_sanity(result["requests"])
    assert s["tpot_s"]["count"] > 0 and s["itl_s"]["count"] > 0 and s["ttst_s"]["count"] > 0
    assert s["throughput"]["output_tokens_per_s"] > 0 and s["jct"]["all_agents_s"] > 0
    hit = s["hit_rate"]
    assert hit["per_turn"][0]["hit_rate"] == 0.0  # a fresh content salt: the first turn is cold
    assert hit["from_turn_2"] > 0.9, hit
    assert len(list((tmp_path / "p").glob("*.png"))) == 4


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared trace not present")
def test_mooncake_slice_online(cluster: UpProcess, tmp_path: Path) -> None:
    out = tmp_path / "mooncake.json"
    replay = (
        "replay --format mooncake --mode online --arrivals trace --limit 30 --time-scale 0.05 "
        "--length-scale 0.05 --max-context 2048 --progress off"
    )  # no --vocab-size: token ids from the served model's vocabulary (its model card says how large)
    loadgen(*replay.split(), "--url", cluster.url, "--trace", str(MOONCAKE), "--out", str(out))
    result = load_result(out)
    s = result["summary"]
    failures = [(r.get("error_code"), r.get("error")) for r in result["requests"] if r.get("error")]
    assert s["requests"]["completed"] == 30 and s["requests"]["failed"] == 0, (s["requests"], failures)
    check_request_sanity(result["requests"])
    with MOONCAKE.open() as f:
        last_ms = [orjson.loads(next(f))["timestamp"] for _ in range(30)][-1]
    assert (
        max(r["t_start_s"] for r in result["requests"]) >= last_ms / 1000 * 0.05 * 0.99
    )  # time-scaled arrivals
    assert s["hit_rate"]["ideal_overall"] > 0  # every request shares the first block (hash id 0)
    with urllib.request.urlopen(f"{cluster.url}/v1/models", timeout=10) as resp:
        card = orjson.loads(resp.read())["data"][0]
    assert card["vocab_size"] > 256 and result["meta"]["config"]["vocab_size"] == card["vocab_size"]
    text = loadgen("compare", str(out), str(out))
    assert "ttft_s.p50" in text and "1.000" in text


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared trace not present")
def test_failed_requests_are_reported_and_fail_the_run(cluster: UpProcess, tmp_path: Path) -> None:
    replay = "replay --format mooncake --mode offline --limit 2 --length-scale 0.05 --vocab-size 32000"
    proc = run_loadgen(*replay.split(), "--progress", "off", "--url", cluster.url, "--trace", str(MOONCAKE),
                       "--out", str(tmp_path / "r.json"))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 ok, 2 failed" in proc.stdout
    assert "requests failed; the first" in proc.stderr and "invalid_request" in proc.stderr

"""The `kvpath loadgen` command: synth -> stats, errors as one line, config validation, compare and plots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadgen.cli import main
from loadgen.config import ReplayConfig
from loadgen.report import compare_rows, flatten, format_compare
from loadgen.result import SCHEMA, load_result, write_result
from shared.config import build_config
from shared.errors import ConfigError

MOONCAKE = Path("/work/shared/traces/mooncake_conversation.jsonl")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_synth_then_stats_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    rc, text, _ = run(
        capsys, "synth", "--profile", "gaia", "--agents", "300", "--seed", "4", "--out", str(out)
    )
    assert rc == 0 and "wrote 300 agents of gaia" in text
    rc, text, _ = run(capsys, "stats", str(out), "--json")
    stats = orjson.loads(text)
    assert rc == 0 and stats["format"] == "kvpath" and stats["trajectories"] == 300
    assert {
        "requests",
        "input_mean",
        "output_mean",
        "turns",
        "append",
        "gen",
        "total",
        "context",
        "ideal_hit_rate",
    } <= set(stats)
    assert stats["input_mean"] == pytest.approx(6161.02, rel=0.05)
    assert all(abs(e) < 0.05 for e in stats["published_error"].values())


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared trace not present")
def test_stats_on_mooncake_through_the_kvpath_command() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "loadgen",
            "stats",
            str(MOONCAKE),
            "--format",
            "mooncake",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    stats = orjson.loads(proc.stdout)
    assert round(stats["input_mean"]) == 12035 and round(stats["output_mean"]) == 343


def test_malformed_trace_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"agent": "a", "rounds": [{"append": 5, "gen": 1}]}\n{"agent": "b", "rounds": [{"gen": 1}]}\n'
    )
    rc, _, err = run(capsys, "stats", str(bad))
    assert rc == 2
    assert err.strip() == f"kvpath loadgen: error: {bad}:2: round 0: missing field 'append'"


def test_replay_config_validation() -> None:
    def build(**overrides: object) -> ReplayConfig:
        base = {"url": "http://127.0.0.1:1", "trace": "t.jsonl"}
        return build_config(ReplayConfig, section="loadgen", env={}, overrides={**base, **overrides})  # type: ignore[type-var]

    assert build().mode == "offline"
    assert build(max_concurrency="4", exact_lengths="false").exact_lengths is False
    for bad, pattern in (
        ({"url": ""}, "url"),
        ({"url": "127.0.0.1:8000"}, "must start with http"),
        ({"mode": "batch"}, "one of offline, online"),
        ({"mode": "online", "arrivals": "poisson"}, "need --rate"),
        ({"extra_body": "{oops"}, "not valid JSON"),
        ({"extra_body": "[1]"}, "must be a JSON object"),
        ({"length_scale": "0"}, "length_scale"),
        ({"steady_tolerance": "2"}, "steady_tolerance"),
    ):
        with pytest.raises(ConfigError, match=pattern):
            build(**bad)
    assert build(extra_body='{"top_k": 5}').extra_body_dict() == {"top_k": 5}


def fake_result(label: str, ttft: float, rate: float | None) -> dict[str, object]:
    requests = [
        {
            "t_ready_s": 0.0,
            "t_start_s": 0.1 * i,
            "ttft_s": ttft,
            "ttst_s": 0.01,
            "tpot_s": 0.02,
            "e2e_s": 0.5,
            "t_end_s": 0.1 * i + 0.5,
            "output_tokens": 8,
            "error": None,
        }
        for i in range(20)
    ]
    summary = {
        "ttft_s": {"p50": ttft},
        "throughput": {"requests_per_s": rate},
        "hit_rate": {
            "from_turn_2": 0.9,
            "per_turn": [
                {"turn": 1, "hit_rate": 0.0, "ideal_hit_rate": 0.0},
                {"turn": 2, "hit_rate": 0.9, "ideal_hit_rate": 0.95},
            ],
        },
        "sessions": 3,
        "flag": True,
    }
    return {
        "schema": SCHEMA,
        "meta": {"label": label},
        "summary": summary,
        "samples": {"itl_s": [0.02, 0.03]},
        "requests": requests,
    }


def test_compare_rows_and_text() -> None:
    a, b = fake_result("base", 0.5, 2.0), fake_result("new", 0.25, None)
    assert flatten(a["summary"]) == {
        "ttft_s.p50": 0.5,
        "throughput.requests_per_s": 2.0,  # type: ignore[arg-type]
        "hit_rate.from_turn_2": 0.9,
        "sessions": 3.0,
    }
    rows = {r["metric"]: r for r in compare_rows(a, b)}
    assert rows["ttft_s.p50"]["ratio"] == 0.5 and rows["throughput.requests_per_s"]["ratio"] is None
    text = format_compare(a, b)
    assert "A: base" in text and "B: new" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("ttft_s.p50"))
    assert line.split()[1:] == ["0.5", "0.25", "0.500"]


def test_compare_and_plot_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_result(tmp_path / "a.json", fake_result("base", 0.5, 2.0))
    write_result(tmp_path / "b.json", fake_result("new", 1.0, 3.0))
    assert load_result(tmp_path / "a.json")["meta"] == {"label": "base"}
    rc, text, _ = run(capsys, "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json")
    assert (
        rc == 0 and {r["metric"]: r["ratio"] for r in orjson.loads(text)}["throughput.requests_per_s"] == 1.5
    )
    rc, text, _ = run(
        capsys,
        "plot",
        str(tmp_path / "a.json"),
        str(tmp_path / "b.json"),
        "--out-dir",
        str(tmp_path / "plots"),
    )
    assert rc == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == [
        "hit_rate_per_turn.png",
        "latency_cdf.png",
        "throughput_over_time.png",
        "ttft_over_time.png",
    ]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    single = fake_result("one-turn", 0.5, 2.0)
    single["summary"]["hit_rate"]["per_turn"] = [{"turn": 1, "hit_rate": 0.0, "ideal_hit_rate": 0.0}]  # type: ignore[index]
    write_result(tmp_path / "c.json", single)
    rc, _, _ = run(capsys, "plot", str(tmp_path / "c.json"), "--out-dir", str(tmp_path / "single"))
    assert rc == 0 and "hit_rate_per_turn.png" not in {p.name for p in (tmp_path / "single").iterdir()}
    (tmp_path / "junk.json").write_text('{"schema": "other"}')
    rc, _, err = run(capsys, "compare", str(tmp_path / "a.json"), str(tmp_path / "junk.json"))
    assert rc == 2 and "not a loadgen result" in err

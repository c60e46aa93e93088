"""`kvpath bench movequery`'s pure half: calibrating the cost model on measured points recovers the
constants that made them, and the report carries what --json promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.bench.movequery import build_report, calibrate, format_report
from loadgen.bench.movequery_fanin import format_fanin, peak_concurrent
from loadgen.bench.movequery_plot import plot
from services.policy.movequery import ModelShape

SHAPE = ModelShape(
    num_layers=4,
    rows_per_token=8,
    query_bytes_per_row=128,
    partial_bytes_per_row=136,
    kv_bytes_per_token_layer=512,
)


def synthetic() -> dict:
    """Points made by probe 0.5 ms + rows x 264 B at 1 GB/s + 30 ns per key + 2 ns per row x key; fetch 0.4
    ms + bytes at 4 GB/s; local 1 us per token x layer."""
    route = [
        {"rows": r, "chunk": c, "s": 5e-4 + r * 264 / 1e9 + 3e-8 * c + 2e-9 * r * c}
        for r in (8, 64, 256, 1024)
        for c in (256, 4096)
    ]
    fetch = {c: 4e-4 + c * 512 * 4 / 4e9 for c in (256, 1024, 4096)}
    return {"route": {"shm": route}, "fetch": {"shm": fetch}, "local": {c: c * 4 * 1e-6 for c in fetch}}


def test_calibration_recovers_the_constants_and_the_report_has_the_json_fields() -> None:
    measured = synthetic()
    profile = calibrate(SHAPE, measured, ["shm"])
    fabric = profile.fabric("shm")
    assert fabric.t_probe_s == pytest.approx(5e-4, rel=1e-6)
    assert fabric.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert profile.compute.attention_s_per_row_key == pytest.approx(2e-9, rel=1e-6)
    assert profile.compute.attention_s_per_key == pytest.approx(3e-8, rel=1e-6)
    assert profile.fetch_bandwidth_bytes_per_s == pytest.approx(4e9, rel=1e-6)
    assert profile.compute.local_s_per_token_layer == pytest.approx(1e-6, rel=1e-6)
    report = build_report(profile, measured, ["shm"], 3e-7)
    assert report["model_mape"] == pytest.approx(0, abs=1e-9)
    assert report["merge_max_rel_err"] == 3e-7 and report["fanin"] == []
    assert "model MAPE" in format_report(report)


def test_fanin_concurrency_and_the_png(tmp_path: Path) -> None:
    """`peak_concurrent` counts streams open at once (a stream ending as another starts overlaps it); the PNG
    carries measured vs model and the fan-in per primitive and memory configuration."""
    assert peak_concurrent([(0, 2), (1, 3), (2, 4), (5, 6)]) == 3
    assert peak_concurrent([(0, 1), (1.5, 2)]) == 1 and peak_concurrent([]) == 0
    report = build_report(calibrate(SHAPE, synthetic(), ["shm"]), synthetic(), ["shm"], 3e-7)
    for kv_blocks in (0, 128):
        for n, primitive in ((4, "route"), (8, "route"), (4, "auto")):
            row = {"n": n, "primitive": primitive, "ttft_p50_s": 0.1 * n, "decode_tok_s": 10.0}
            report["fanin"].append(row | {"kv_blocks": kv_blocks, "kv_bytes": 1e6, "peak_concurrent": n})
    assert "at once" in format_fanin(report["fanin"])
    path = tmp_path / "mq.png"
    plot(report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000

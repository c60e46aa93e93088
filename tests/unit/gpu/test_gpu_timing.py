"""`kvpath bench model` end to end on a small setting: the timed runs (gpu/timing.py), then the command's
table and JSON (loadgen/bench/model.py) and the command itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu.model_spec import resolve_model
from gpu.timing import TimingConfig, run_timings, torch_threads
from loadgen.bench.model import format_table, rows_json
from services.cli import main as cli_main
from tests.unit.gpu.gguf_writer import write_tiny_gguf


def test_bench_model_runs_side_by_side(model_cache: str, tmp_path: Path) -> None:
    config = TimingConfig(
        models=["tiny", "tiny-mla"],
        batch_sizes=[1, 2],
        prompt_len=8,
        new_tokens=3,
        repeats=1,
        cache_dir=model_cache,
    )
    rows = run_timings(config)
    assert [(r.model, r.batch_size) for r in rows] == [
        ("tiny", 1),
        ("tiny", 2),
        ("tiny-mla", 1),
        ("tiny-mla", 2),
    ]
    for row in rows:
        assert row.prefill_tok_s > 0 and row.decode_tok_s > 0
        assert row.hf_prefill_tok_s and row.hf_decode_tok_s and row.decode_speedup
    table = format_table(rows)
    assert "tiny-mla" in table and "hf decode" in table
    payload = json.loads(rows_json(rows, config, torch_threads()))
    assert len(payload["rows"]) == 4 and payload["torch_threads"] >= 1


def test_bench_model_times_a_gguf_file_next_to_transformers_own_gguf_loader(
    model_cache: str, tmp_path: Path
) -> None:
    """The served default (SmolLM2) is a GGUF file: transformers must load it with `gguf_file`, not as a
    folder (it raised "not a valid JSON file" before)."""
    gguf_path = write_tiny_gguf(Path(resolve_model("tiny", model_cache)), tmp_path / "tiny-f32.gguf")
    config = TimingConfig(models=[str(gguf_path)], batch_sizes=[1], prompt_len=8, new_tokens=3, repeats=1)
    [row] = run_timings(config)
    assert row.model == str(gguf_path) and row.decode_tok_s > 0
    assert row.hf_prefill_tok_s and row.hf_decode_tok_s and row.decode_speedup


def test_bench_model_command(model_cache: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "model.json"
    args = ["bench", "model", "--models", "tiny", "--batch-sizes", "1", "--prompt-len", "4"]
    args += ["--new-tokens", "2", "--repeats", "1", "--no-transformers", "--cache-dir", model_cache]
    assert cli_main([*args, "--json", str(out_path)]) == 0
    printed = capsys.readouterr().out
    assert "torch threads:" in printed and "prefill tok/s" in printed
    payload = json.loads(out_path.read_text())
    assert payload["config"]["models"] == ["tiny"] and payload["rows"][0]["hf_decode_tok_s"] is None

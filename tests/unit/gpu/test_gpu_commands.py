"""`kvpath generate` as a real subprocess and in-process with its options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq
from gpu.sampling import SamplingOptions
from services.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]


def kvpath(model_cache: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVPATH_MODEL_CACHE": model_cache, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=90,
    )


async def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    blocks = runner.kv.allocate(1)
    try:
        token = (await runner.prefill([PrefillSeq("g", blocks, 0, prompt, sampling=SamplingOptions(0.0))]))[0]
        out = [int(token or 0)]
        while len(out) < n:
            step = DecodeSeq("g", blocks, len(prompt) + len(out) - 1, out[-1], sampling=SamplingOptions(0.0))
            out.append((await runner.decode([step]))[0])
        return out
    finally:
        runner.kv.free(blocks)


async def test_generate_json_subprocess(model_cache: str, tiny_runner: ModelRunner) -> None:
    result = kvpath(
        model_cache,
        "generate",
        "--model",
        "tiny",
        "--prompt",
        "Hello, kv!",
        "--max-tokens",
        "6",
        "--json",
        "--ignore-eos",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) == {"token_ids", "text"}
    expected = await greedy(tiny_runner, tiny_runner.tokenizer.encode("Hello, kv!"), 6)
    assert payload["token_ids"] == expected
    assert payload["text"] == tiny_runner.tokenizer.decode(expected)


def run_cli(capsys: pytest.CaptureFixture[str], model_cache: str, *args: str) -> tuple[int, str, str]:
    """The same command in this process (cheaper than a subprocess per variant)."""
    code = cli_main([*args, "--cache-dir", model_cache])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_options(model_cache: str, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", "--model", "tiny-mla", "--max-tokens", "5", "--json", "--ignore-eos"]
    seeded = [*common, "--prompt-ids", "256,72,105", "--temperature", "0.9", "--seed", "7"]
    first, second = run_cli(capsys, model_cache, *seeded), run_cli(capsys, model_cache, *seeded)
    assert first[0] == 0 and first[1] == second[1]
    assert len(json.loads(first[1])["token_ids"]) == 5
    code, out, _ = run_cli(capsys, model_cache, *common, "--prompt", "hi", "--chat")
    assert code == 0 and json.loads(out)["token_ids"]
    code, out, _ = run_cli(
        capsys, model_cache, "generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "3"
    )
    assert code == 0 and out.endswith("\n")
    code, _, err = run_cli(capsys, model_cache, "generate", "--model", "nope", "--prompt", "x")
    assert code == 2 and "not found" in err
    code, _, err = run_cli(capsys, model_cache, "generate", "--model", "tiny", "--prompt-ids", "1,x")
    assert code == 2 and "integers" in err

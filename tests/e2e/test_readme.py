"""The README's usage examples, run as written against a real `kvpath up` (only the port differs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from services.up.process import UpProcess

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def cluster(smollm2_cluster: UpProcess) -> UpProcess:
    """`kvpath up` with the default model, as `make run` (tests/conftest.py, shared)."""
    return smollm2_cluster


def test_the_two_commands_are_what_make_and_ci_run() -> None:
    text = README.read_text()
    assert "make run" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M), "CI must call exactly the README's test command"


def test_curl_examples(cluster: UpProcess) -> None:
    [shell] = blocks("sh")
    commands = [c for c in re.split(r"\n\s*\n", shell.strip()) if c.startswith("curl")]
    assert len(commands) == 2
    for command in commands:
        command = command.replace("http://127.0.0.1:8000", cluster.url)
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True)
        if '"stream": true' in command:
            events = [line[len("data: ") :] for line in out.stdout.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            usage = orjson.loads(events[-2])["usage"]
            # sampled (temperature 1): EOS may come first, so only the usage fields are certain
            assert usage["prompt_tokens"] > 0 and "cached_tokens" in usage["prompt_tokens_details"]
        else:
            body = orjson.loads(out.stdout)
            assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] >= 1
            assert body["choices"][0]["text"].startswith(" Paris.")  # the default model is a real one


def test_python_example(cluster: UpProcess) -> None:
    [code] = blocks("python")
    code = code.replace("http://127.0.0.1:8000", cluster.url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    # the printed lines are the ones the README shows: real answers, and turn 2 loading turn 1's KV
    shown = [line[2:] for line in code.splitlines() if line.startswith("# The capital")]
    assert out.stdout.splitlines() == shown

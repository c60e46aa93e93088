"""`kvpath bench agent --only context` against `kvpath up` with a KV store: one session whose turns re-send
a long context; every turn after the first must hit >= 90% of its prompt, reported per turn."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from services.cli import main as cli_main
from tests.cluster import UpProcess

pytestmark = pytest.mark.slow


def test_a_long_context_session_hits_its_context_every_later_turn(
    kv_store_cluster: UpProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "agent.json"
    args = ["bench", "agent", "--url", kv_store_cluster.url, "--only", "context"]
    args += ["--context-tokens", "1500", "--context-turns", "3", "--json", str(out)]
    assert cli_main(args) == 0, capsys.readouterr().out
    assert "long context (1500 tokens, 3 turns)" in capsys.readouterr().out
    context = json.loads(out.read_text())["context"]
    turns = context["turns"]
    assert [t["prompt_tokens"] for t in turns] == [1600, 1704, 1808]
    for before, turn in itertools.pairwise(turns):  # the previous prompt's full blocks, at least
        assert turn["cached_tokens"] >= before["prompt_tokens"] // 64 * 64, turns
    assert context["ok"] and context["later_hit_ratio_min"] >= 0.9


def test_sessions_at_once_are_reported_together_and_each_hits_its_own_context(
    kv_store_cluster: UpProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "agents.json"
    args = ["bench", "agent", "--url", kv_store_cluster.url, "--only", "context", "--context-sessions", "3"]
    args += ["--context-tokens", "1500", "--context-turns", "2", "--json", str(out)]
    assert cli_main(args) == 0, capsys.readouterr().out
    assert "long context, 3 sessions at once (1500 tokens, 2 turns)" in capsys.readouterr().out
    context = json.loads(out.read_text())["context"]
    sessions = context["sessions"]
    assert len(sessions) == 3 and context["ok"]
    for s in sessions:  # different contexts (seeds): each later turn hits its own session's blocks
        first, later = s["turns"]
        assert first["prompt_tokens"] == 1600 and later["cached_tokens"] >= 1600, s
    later = [s["turns"][1]["ttft_ms"] for s in sessions]
    assert context["later_ttft_ms_max"] == max(later) and context["later_hit_ratio_min"] >= 0.9

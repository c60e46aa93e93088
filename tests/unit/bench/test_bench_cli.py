"""The `kvpath` command finds the commands of higher floors through its entry-point group: `--help` lists
them, a bench runs, services never imports loadgen, and a missing installation is a clear error."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import cli

REPO = Path(__file__).resolve().parents[3]


def kvpath(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_help_lists_every_command_and_bench() -> None:
    top = kvpath("--help")
    assert top.returncode == 0, top.stderr
    for command in ("serve", "up", "generate", "loadgen", "bench"):
        assert f"    {command} " in top.stdout
    bench = kvpath("bench", "--help")
    assert bench.returncode == 0, bench.stderr
    for name in (
        "serve",
        "router",
        "dualpath",
        "beluga",
        "tracing",
        "storage",
        "index",
        "transport",
        "model",
    ):
        assert f"    {name}" in bench.stdout


def test_a_bench_runs_through_the_plugin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "index.json"
    args = ["bench", "index", "--blocks", "2000", "--chain", "16", "--matches", "20", "--event-blocks", "100"]
    assert cli.main([*args, "--json", str(out_path)]) == 0
    assert capsys.readouterr().out
    assert json.loads(out_path.read_text())["match_recent_u64"]["p50_us"] > 0


def test_the_plugins_are_the_installed_entry_points() -> None:
    names = {e.name: e.value for e in cli.plugin_commands()}
    assert names == {"bench": "loadgen.bench:register", "loadgen": "loadgen.cli:register"}


def test_no_plugins_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    with pytest.raises(SystemExit, match=r"kvpath\.commands.*not installed"):
        cli.main(["--help"])
    # a service still starts: `kvpath serve` needs no command of a higher floor
    assert cli.build_parser(with_plugins=False).parse_args(["serve", "router"]).service == "router"


def named_modules(tree: ast.AST) -> Iterator[str]:
    """Modules a file imports, and strings that name a loadgen module (for importlib)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or ""
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("loadgen.")
        ):
            yield node.value


def test_services_import_nothing_from_loadgen() -> None:
    for path in sorted((REPO / "services").rglob("*.py")):
        for module in named_modules(ast.parse(path.read_text(), str(path))):
            assert module.split(".")[0] != "loadgen", f"{path.relative_to(REPO)} names {module}"

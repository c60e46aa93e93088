"""`kvpath bench placement`: the router's own placement queue over synthetic reports; every round places
up to --waiting requests, the JSON carries the round times and a digest of the decisions, equal for equal
seeds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadgen.bench import register


def _run(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp_path / f"{name}.json"
    args = parser.parse_args(
        ["bench", "placement", "--prefill-nodes", "2", "--decode-nodes", "4", "--engines-per-node", "2",
         "--rounds", "40", "--reports-per-round", "3", "--json", str(out), *extra]
    )  # fmt: skip
    assert args.func(args) == 0
    return list(json.loads(out.read_text())["results"])


def test_rounds_place_and_equal_seeds_decide_alike(tmp_path: Path) -> None:
    first = _run(tmp_path, "a")
    assert [r["policy"] for r in first] == ["dualpath", "dualpath-rr", "basic"]
    for row in first:
        assert row["engines"] == 12 and row["rounds"] == 40 and row["placed"] > 0
        assert 0 < row["round_p50_ms"] <= row["round_p90_ms"]
    again = _run(tmp_path, "b")
    assert [r["decisions"] for r in again] == [r["decisions"] for r in first]
    other = _run(tmp_path, "c", "--seed", "2")
    assert [r["decisions"] for r in other] != [r["decisions"] for r in first]

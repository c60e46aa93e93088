"""The error table of docs/deploy.md is the one in shared/errors.py: every code, with its HTTP status."""

from __future__ import annotations

import re
from pathlib import Path

from shared import errors

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def test_the_documented_error_table_matches_the_code() -> None:
    section = DOC.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    documented = {
        m[1]: int(m[2]) for m in re.finditer(r"^\| `([a-z_]+)` \| (\d{3}) \|", section, re.MULTILINE)
    }
    assert documented == {code: cls.http_status for code, cls in errors._BY_CODE.items()}

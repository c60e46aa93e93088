"""Print the dependencies of pyproject.toml (plus optional extras), one requirement a line.

The Dockerfile installs these before copying the sources, so the dependency layer is rebuilt only when
pyproject.toml or the constraints change, not on every source edit:

    python deploy/pyproject_deps.py pyproject.toml gpu > requirements.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """`[project] dependencies` followed by each named extra's; an unknown extra raises KeyError."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise KeyError(f"{pyproject}: no optional dependency group {extra!r} (have {sorted(optional)})")
        out += optional[extra]
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: pyproject_deps.py PYPROJECT [EXTRA ...]", file=sys.stderr)
        return 2
    extras = [e for part in argv[1:] for e in part.split(",") if e]
    try:
        lines = requirements(Path(argv[0]), extras)
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        print(f"pyproject_deps: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

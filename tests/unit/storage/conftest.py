"""A real, tiny file system (tmpfs) for out-of-space tests; skipped where mounting is not allowed."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "small-fs"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount_point)],
        capture_output=True,
        timeout=10,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=10)

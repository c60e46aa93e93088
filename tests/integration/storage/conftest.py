"""Fixtures of the storage integration tests (helpers live in storage_harness.py)."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shared.natsserver import NatsServer
from tests.integration.storage.storage_harness import StorageCluster


@pytest.fixture
async def cluster(nats_server: NatsServer, namespace: str, tmp_path: Path) -> AsyncIterator[StorageCluster]:
    c = StorageCluster(nats_server, namespace, tmp_path)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 128 KiB file system (tmpfs) to fill up; skipped where mounting is not allowed."""
    mount_point = tmp_path / "tiny-fs"
    mount_point.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount_point)]
    result = subprocess.run(cmd, capture_output=True, timeout=10)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=10)

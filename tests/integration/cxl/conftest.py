"""Fixtures of the CXL-RPC process tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from shared.shm import segment_path


@pytest.fixture
def segment_name() -> Iterator[str]:
    name = "kvpath-test-cxl-" + uuid.uuid4().hex[:10]
    yield name
    segment_path(name).unlink(missing_ok=True)  # a killed server leaves its file behind

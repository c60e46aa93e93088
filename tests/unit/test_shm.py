"""Shared-memory segments: two mappings see the same bytes; the owner unlinks on close."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from shared.shm import ShmSegment, remove_segments, segment_path


def test_two_mappings_share_bytes() -> None:
    name = "kvpath-test-" + uuid.uuid4().hex[:8]
    owner = ShmSegment.create(name, 4096)
    peer = ShmSegment.attach(name)
    try:
        assert peer.size == 4096
        owner.array(np.uint32, offset=64, count=4)[:] = [1, 2, 3, 4]
        assert peer.array(np.uint32, offset=64, count=4).tolist() == [1, 2, 3, 4]
        peer.buf[0:3] = b"abc"
        assert bytes(owner.buf[0:3]) == b"abc"
    finally:
        peer.close()
        owner.close()
    assert not segment_path(name).exists()


def test_bad_names_and_sizes() -> None:
    with pytest.raises(ValueError):
        ShmSegment.create("../etc/passwd", 10)
    with pytest.raises(ValueError):
        ShmSegment.create("kvpath-zero", 0)
    with pytest.raises(FileNotFoundError):
        ShmSegment.attach("kvpath-missing-" + uuid.uuid4().hex[:8])


def test_remove_segments_by_prefix() -> None:
    prefix = "kvpath-rm" + uuid.uuid4().hex[:6] + "-"
    segments = [ShmSegment.create(prefix + name, 64) for name in ("a", "b")]
    other = ShmSegment.create("kvpath-keep-" + uuid.uuid4().hex[:6], 64)
    try:
        assert remove_segments(prefix) == 2
        assert not any(segment_path(s.name).exists() for s in segments)
        assert segment_path(other.name).exists()
    finally:
        for s in (*segments, other):
            s.close()

"""Regions: bounds-checked zero-copy views; shm-backed ones are visible to another mapping."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from shared.errors import TransportError
from shared.shm import ShmSegment, segment_path
from shared.transport.region import Region


def test_shm_region_is_shared_and_unlinked_on_close() -> None:
    name = "kvpath-test-region-" + uuid.uuid4().hex[:8]
    region = Region("kv buffer #0", 1, 4096, shm_name=name)
    assert region.shm_segment == name
    other = ShmSegment.attach(name)
    try:
        other.array(np.uint8, 100, 4)[:] = [1, 2, 3, 4]
        assert region.view(100, 4).tolist() == [1, 2, 3, 4]
        region.buffer(0, 2)[:] = b"hi"
        assert bytes(other.buf[:2]) == b"hi"
    finally:
        other.close()
    region.close()
    assert not region.is_open and not segment_path(name).exists()


def test_private_region_and_bounds() -> None:
    region = Region("r", 2, 1000, shm_name=None)
    assert region.shm_segment == "" and region.address() > 0
    assert region.view(0, 1000).nbytes == 1000 and region.view(1000, 0).nbytes == 0
    for offset, length in ((-1, 1), (999, 2), (0, 1001), (5, -1)):
        with pytest.raises(TransportError, match="outside") as info:
            region.view(offset, length)
        assert info.value.param == "offset"
    region.close()


def test_bad_region_arguments() -> None:
    with pytest.raises(TransportError, match="size"):
        Region("r", 1, 0, shm_name=None)
    with pytest.raises(TransportError, match="name"):
        Region("", 1, 10, shm_name=None)

"""The CXL-RPC segment layout: every line 64-byte aligned, nothing overlaps, the header describes it."""

from __future__ import annotations

import itertools

import pytest

from shared.cxl.layout import (
    CACHE_LINE_BYTES,
    CLIENT_TABLE_OFFSET,
    DOORBELL_OFFSET,
    EPOCH_OFFSET,
    HEADER,
    HEARTBEAT_OFFSET,
    SLEEPING_OFFSET,
    Layout,
)
from shared.cxl.rpc_config import RpcConfig
from shared.protocol.subjects import Subjects


def _regions(layout: Layout) -> list[tuple[int, int, str]]:
    out = [(0, 2 * CACHE_LINE_BYTES, "header")]
    for c in range(layout.num_clients):
        out.append((layout.client_entry(c), 2 * CACHE_LINE_BYTES, f"entry {c}"))
        for q in range(layout.queue_depth):
            out.append((layout.request_descriptor(c, q), CACHE_LINE_BYTES, f"req {c}/{q}"))
            out.append((layout.response_descriptor(c, q), CACHE_LINE_BYTES, f"resp {c}/{q}"))
            out.append((layout.request_payload(c, q), layout.payload_bytes, f"req payload {c}/{q}"))
            out.append((layout.response_payload(c, q), layout.payload_bytes, f"resp payload {c}/{q}"))
    return sorted(out)


@pytest.mark.parametrize("geometry", [(1, 1, 64), (3, 4, 16384), (16, 8, 1024)])
def test_lines_are_aligned_disjoint_and_inside_the_segment(geometry: tuple[int, int, int]) -> None:
    layout = Layout(*geometry)
    regions = _regions(layout)
    for offset, size, what in regions:
        assert offset % CACHE_LINE_BYTES == 0, what
        assert offset + size <= layout.size_bytes, what
    for (a, a_size, a_what), (b, _, b_what) in itertools.pairwise(regions):
        assert a + a_size <= b, f"{a_what} overlaps {b_what}"
    assert layout.slots_offset % 4096 == 0
    assert layout.size_bytes == layout.slots_offset + layout.num_clients * layout.client_stride


def test_header_fields_sit_where_the_docstring_says() -> None:
    assert (EPOCH_OFFSET, HEARTBEAT_OFFSET, SLEEPING_OFFSET, DOORBELL_OFFSET) == (24, 32, 64, 68)
    assert HEADER.size <= CACHE_LINE_BYTES and CLIENT_TABLE_OFFSET == 2 * CACHE_LINE_BYTES
    # the sequence numbers and futex words are naturally aligned (single stores, futex needs 4 bytes)
    layout = Layout(2, 2, 128)
    assert layout.request_descriptor(1, 1) % 8 == 0 and (layout.client_entry(1) + 72) % 4 == 0


def test_the_header_round_trips_and_is_checked_against_the_file() -> None:
    layout = Layout(5, 3, 8192)
    header = layout.pack_header(epoch=7, heartbeat_ns=11, pid=13)
    assert Layout.from_header(header, layout.size_bytes) == layout
    with pytest.raises(ValueError, match="header describes"):
        Layout.from_header(header, layout.size_bytes - 64)
    with pytest.raises(ValueError, match="not a CXL-RPC segment"):
        Layout.from_header(b"\0" * HEADER.size, layout.size_bytes)


def test_bad_geometry_and_config_are_refused() -> None:
    for geometry in [(0, 1, 64), (1, 0, 64), (1, 1, 100), (1, 1, 0), (5000, 1, 64)]:
        with pytest.raises(ValueError):
            Layout(*geometry)
    with pytest.raises(ValueError, match="server_stale_s"):
        RpcConfig(server_stale_s=0.05, idle_wake_s=0.1).validate()
    with pytest.raises(ValueError, match="client_spin_s"):
        RpcConfig(client_spin_s=-1).validate()
    assert RpcConfig().layout.payload_bytes >= 8 * 1000  # a LOOKUP of 1000 hashes fits by default


def test_the_nats_subject_is_built_from_a_checked_pool_id() -> None:
    subjects = Subjects("ns")
    assert subjects.cxl_rpc("pool-0") == "kvpath.ns.cxl.rpc.pool-0"
    with pytest.raises(ValueError):
        subjects.cxl_rpc("pool.*")

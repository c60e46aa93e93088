"""Frame headers and extent tables: round trips, and every malformed field rejected by name."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import TransportError
from shared.transport.wire import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    RECEIVER_TYPES,
    SENDER_TYPES,
    Flag,
    FrameError,
    FrameType,
    Header,
    Limits,
    check_tag,
    extents_in_bounds,
    pack,
    pack_extents,
    unpack,
    unpack_extents,
)

LIMITS = Limits(max_meta_bytes=1024, max_extents=8, max_payload_bytes=1 << 20)


def _raw(**fields: int) -> bytes:
    values = {
        "magic": MAGIC,
        "type": int(FrameType.ACK),
        "flags": 0,
        "seq": 1,
        "region_id": 0,
        "tag": 0,
        "aux": 0,
        "meta_len": 0,
        "payload_len": 0,
        "value": 0,
    }
    values.update(fields)
    return HEADER.pack(*values.values())


def test_header_round_trip() -> None:
    header = Header(
        FrameType.WRITE,
        Flag.NOTICE,
        seq=7,
        region_id=3,
        tag=0xFFFFFFFF,
        aux=2,
        meta_len=5,
        payload_len=4096,
        value=11,
    )
    data = pack(header)
    assert len(data) == HEADER_BYTES == 40
    assert unpack(data, LIMITS, SENDER_TYPES) == header
    assert header.table_len == 32 and header.has_notice


@pytest.mark.parametrize(
    ("fields", "allowed", "message"),
    [
        ({"magic": 0x1234}, RECEIVER_TYPES, "magic"),
        ({"type": 77}, RECEIVER_TYPES, "unknown frame type"),
        ({"type": int(FrameType.WRITE)}, RECEIVER_TYPES, "not expected"),
        ({"type": int(FrameType.ACK)}, SENDER_TYPES, "not expected"),
        ({"flags": 0x80}, RECEIVER_TYPES, "flags"),
        ({"meta_len": 1025}, RECEIVER_TYPES, "meta"),
        ({"payload_len": 1}, RECEIVER_TYPES, "may not carry a payload"),
        ({"type": int(FrameType.WRITE), "aux": 9}, SENDER_TYPES, "extents"),
        ({"type": int(FrameType.WRITE), "payload_len": (1 << 20) + 1}, SENDER_TYPES, "exceeds"),
    ],
)
def test_malformed_headers_are_rejected(
    fields: dict[str, int], allowed: frozenset[FrameType], message: str
) -> None:
    with pytest.raises(FrameError, match=message):
        unpack(_raw(**fields), LIMITS, allowed)


def test_extent_table_round_trip_and_bounds() -> None:
    table = unpack_extents(pack_extents([0, 100, 4000], [10, 0, 96]), 3)
    assert table.tolist() == [[0, 10], [100, 0], [4000, 96]]
    assert extents_in_bounds(table, 4096)
    assert not extents_in_bounds(table, 4095)
    assert extents_in_bounds(np.zeros((0, 2), np.uint64), 0)
    # offset + length would wrap a u64: still out of bounds, not "small"
    wrap = unpack_extents(pack_extents([10], [(1 << 64) - 5]), 1)
    assert not extents_in_bounds(wrap, 4096)
    assert not extents_in_bounds(unpack_extents(pack_extents([5000], [0]), 1), 4096)


def test_tags_are_u32() -> None:
    assert check_tag(0) == 0 and check_tag(0xFFFFFFFF) == 0xFFFFFFFF
    for bad in (-1, 1 << 32):
        with pytest.raises(TransportError) as info:
            check_tag(bad)
        assert info.value.param == "tag"

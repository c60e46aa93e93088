"""FrameReader: frames split at any byte boundary parse the same; payload lands in the sink's views."""

from __future__ import annotations

import numpy as np
import pytest

from shared.transport.reader import FrameReader
from shared.transport.wire import (
    SENDER_TYPES,
    Flag,
    FrameError,
    FrameType,
    Header,
    Limits,
    pack,
    pack_extents,
)

LIMITS = Limits(max_meta_bytes=4096, max_extents=1024, max_payload_bytes=1 << 24)


class RecordingSink:
    def __init__(self, region: bytearray, *, accept: bool = True) -> None:
        self.region = memoryview(region)
        self.accept = accept
        self.events: list[tuple[str, FrameType, int, bytes]] = []

    def on_frame(self, header: Header, meta: bytes) -> None:
        self.events.append(("frame", header.type, header.seq, meta))

    def on_write_begin(self, header: Header, extents: np.ndarray, meta: bytes) -> list[memoryview] | None:
        self.events.append(("begin", header.type, header.seq, meta))
        if not self.accept:
            return None
        return [self.region[o : o + n] for o, n in extents.tolist()]

    def on_write_end(self, header: Header, meta: bytes) -> None:
        self.events.append(("end", header.type, header.seq, meta))


def _write_frame(seq: int, extents: list[tuple[int, bytes]], meta: bytes = b"") -> bytes:
    payload = b"".join(data for _, data in extents)
    header = Header(
        FrameType.WRITE,
        Flag.NOTICE,
        seq=seq,
        region_id=1,
        tag=5,
        aux=len(extents),
        meta_len=len(meta),
        payload_len=len(payload),
    )
    table = pack_extents([o for o, _ in extents], [len(d) for _, d in extents])
    return pack(header) + table + meta + payload


def _stream() -> tuple[bytes, list[tuple[int, bytes]]]:
    rng = np.random.default_rng(1)
    extents = [(0, rng.bytes(300)), (1000, b""), (500, rng.bytes(77)), (2000, rng.bytes(1500))]
    hello = pack(Header(FrameType.HELLO, seq=1, meta_len=4)) + b"ping"
    notice = pack(Header(FrameType.NOTICE, Flag.NOTICE, seq=3, region_id=1, tag=9, meta_len=2)) + b"ok"
    bare = pack(Header(FrameType.NOTICE, Flag.NOTICE, seq=4, region_id=1, tag=10))  # header only
    empty_write = _write_frame(5, [])  # header only too, but a WRITE: begin and end
    bye = pack(Header(FrameType.BYE))
    return hello + _write_frame(2, extents, b"meta") + notice + bare + empty_write + bye, extents


def _feed(reader: FrameReader, stream: bytes, chunk: int) -> None:
    """What recvmsg_into does: fill the reader's buffers in order, at most `chunk` bytes per call."""
    pos = 0
    while pos < len(stream):
        budget = min(chunk, len(stream) - pos)
        taken = 0
        for buf in reader.buffers():
            n = min(len(buf), budget - taken)
            buf[:n] = stream[pos + taken : pos + taken + n]
            taken += n
            if taken == budget:
                break
        reader.advance(taken)
        pos += taken


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_any_split_gives_same_frames_and_bytes(chunk: int) -> None:
    stream, extents = _stream()
    region = bytearray(4096)
    sink = RecordingSink(region)
    reader = FrameReader(sink, LIMITS, SENDER_TYPES)
    _feed(reader, stream, chunk)
    assert sink.events == [
        ("frame", FrameType.HELLO, 1, b"ping"),
        ("begin", FrameType.WRITE, 2, b"meta"),
        ("end", FrameType.WRITE, 2, b"meta"),
        ("frame", FrameType.NOTICE, 3, b"ok"),
        ("frame", FrameType.NOTICE, 4, b""),
        ("begin", FrameType.WRITE, 5, b""),
        ("end", FrameType.WRITE, 5, b""),
        ("frame", FrameType.BYE, 0, b""),
    ]
    for offset, data in extents:
        assert bytes(region[offset : offset + len(data)]) == data
    assert reader.is_idle


def test_rejected_write_is_drained_and_stream_continues() -> None:
    big = bytes(range(256)) * 1024  # 256 KiB: several scratch-buffer rounds
    stream = _write_frame(1, [(0, big)]) + pack(Header(FrameType.BYE))
    region = bytearray(16)
    sink = RecordingSink(region, accept=False)
    _feed(FrameReader(sink, LIMITS, SENDER_TYPES), stream, 50_000)
    assert [e[:3] for e in sink.events] == [
        ("begin", FrameType.WRITE, 1),
        ("end", FrameType.WRITE, 1),
        ("frame", FrameType.BYE, 0),
    ]
    assert region == bytearray(16)


def test_extent_lengths_must_match_payload() -> None:
    header = Header(FrameType.WRITE, seq=1, region_id=1, aux=1, payload_len=10)
    stream = pack(header) + pack_extents([0], [9]) + b"x" * 10
    reader = FrameReader(RecordingSink(bytearray(64)), LIMITS, SENDER_TYPES)
    with pytest.raises(FrameError, match="do not add up"):
        _feed(reader, stream, 1 << 10)


def test_current_frame_is_visible_mid_payload() -> None:
    stream = _write_frame(4, [(0, b"abcdef")])
    reader = FrameReader(RecordingSink(bytearray(64)), LIMITS, SENDER_TYPES)
    _feed(reader, stream[:-3], 1 << 10)
    assert not reader.is_idle
    assert reader.current is not None and reader.current.seq == 4 and reader.current.tag == 5

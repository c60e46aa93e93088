"""The receiver against hand-made frames: it checks bounds itself, survives malformed input and peers
cut off mid-frame, and refuses bad hellos; a silent receiver is a deadline, not a hang."""

from __future__ import annotations

import asyncio
import socket

import pytest

from shared.errors import DeadlineExceededError, TransportError
from shared.protocol.codec import decode, encode
from shared.protocol.transfer import RegionInfo, TransferHello
from shared.transport import KvReceiver, KvSender
from shared.transport.channel import ControlChannel
from shared.transport.wire import Flag, FrameType, Header, Limits, pack, pack_extents


async def _channel(receiver: KvReceiver, sender_id: str = "raw") -> tuple[ControlChannel, RegionInfo]:
    ep = receiver.endpoint()
    channel = await ControlChannel.open(
        ep["address"], ep["port"], name="rx", limits=Limits(), buffer_bytes=1 << 20
    )
    hello = TransferHello(sender_id=sender_id, backend="tcp")
    await channel.request(Header(FrameType.HELLO, seq=channel.next_seq()), encode(hello))
    _, meta = await channel.request(Header(FrameType.LOOKUP, seq=channel.next_seq()), b"buf")
    return channel, decode(meta, RegionInfo)


def _write(seq: int, region_id: int, extents: list[tuple[int, bytes]], tag: int | None = None) -> bytes:
    payload = b"".join(d for _, d in extents)
    header = Header(
        FrameType.WRITE,
        Flag.NOTICE if tag is not None else Flag.NONE,
        seq=seq,
        region_id=region_id,
        tag=tag or 0,
        aux=len(extents),
        payload_len=len(payload),
    )
    return pack(header) + pack_extents([o for o, _ in extents], [len(d) for _, d in extents]) + payload


async def test_receiver_rejects_out_of_bounds_and_keeps_the_connection(receiver: KvReceiver) -> None:
    channel, info = await _channel(receiver)
    try:
        size = info.size_bytes
        for extents in ([(size - 3, b"abcd")], [(0, b"ok"), (size, b"x")], [((1 << 64) - 2, b"zz")]):
            seq = channel.next_seq()
            future = channel.expect(seq)
            await channel.send([memoryview(_write(seq, info.region_id, extents, tag=1))])
            with pytest.raises(TransportError, match="out of bounds") as exc_info:
                await asyncio.wait_for(future, 5)
            assert exc_info.value.param == "offset"
        assert receiver.region("buf").view(0, 2).tolist() == [0, 0]  # nothing of a rejected op landed
        seq = channel.next_seq()
        future = channel.expect(seq)
        await channel.send([memoryview(_write(seq, info.region_id, [(size - 4, b"abcd")], tag=2))])
        await asyncio.wait_for(future, 5)
        assert bytes(receiver.region("buf").view(size - 4, 4)) == b"abcd"
        assert (await receiver.wait("buf", 2, timeout_s=5)).peer_id == "raw"
        assert receiver.poll("buf", 1) is None
    finally:
        await channel.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 40,  # not our protocol
        pack(Header(FrameType.LOOKUP, seq=1, meta_len=3)) + b"buf",  # no HELLO first
        pack(Header(FrameType.HELLO, seq=1, meta_len=1 << 30)),  # absurd meta length
    ],
)
async def test_malformed_input_closes_that_connection_only(
    receiver: KvReceiver, sender: KvSender, garbage: bytes
) -> None:
    ep = receiver.endpoint()
    reader, writer = await asyncio.open_connection(ep["address"], ep["port"])
    writer.write(garbage)
    await writer.drain()
    try:  # closed by the receiver with nothing answered (a reset when it left bytes unread)
        assert await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        pass
    writer.close()
    peer = await sender.connect(ep, timeout_s=5, backend="tcp")
    await peer.write("buf", 0, b"alive", tag=1, timeout_s=5)
    assert (await receiver.wait("buf", 1, timeout_s=5)).nbytes == 5


async def test_bad_hello_is_answered_then_closed(receiver: KvReceiver) -> None:
    ep = receiver.endpoint()
    channel = await ControlChannel.open(
        ep["address"], ep["port"], name="rx", limits=Limits(), buffer_bytes=1 << 16
    )
    try:
        hello = TransferHello(sender_id="x", backend="rdma")  # not offered by this receiver
        with pytest.raises(TransportError, match="not offered"):
            await channel.request(Header(FrameType.HELLO, seq=1), encode(hello))
        with pytest.raises(TransportError, match="lost"):
            for _ in range(100):
                await channel.request(Header(FrameType.LOOKUP, seq=channel.next_seq()), b"buf")
    finally:
        await channel.close()


async def test_write_cut_off_midway_fails_its_notice(receiver: KvReceiver) -> None:
    channel, info = await _channel(receiver, sender_id="dying")
    waiter = asyncio.ensure_future(receiver.wait("buf", 42, timeout_s=30))  # names no peer
    frame = _write(channel.next_seq(), info.region_id, [(0, bytes(1 << 20))], tag=42)
    await channel.send([memoryview(frame[: len(frame) // 2])])
    await channel.close()
    with pytest.raises(TransportError, match="dying lost mid-transfer"):
        await waiter


async def test_silent_receiver_is_a_deadline(sender: KvSender) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port = listener.getsockname()[1]
        endpoint = {
            "kind": "kv_endpoint",
            "v": 1,
            "receiver_id": "silent",
            "host_id": "elsewhere",
            "address": "127.0.0.1",
            "port": port,
            "backends": ["tcp"],
        }
        with pytest.raises(DeadlineExceededError, match="connect to KV receiver silent"):
            await sender.connect(endpoint, timeout_s=0.3)
    finally:
        listener.close()


async def test_error_replies_decode_to_the_sent_error(receiver: KvReceiver) -> None:
    channel, _ = await _channel(receiver)
    try:
        with pytest.raises(TransportError, match="no region named 'missing'") as info:
            await channel.request(Header(FrameType.LOOKUP, seq=channel.next_seq()), b"missing")
        assert info.value.param == "region"
        notice = Header(FrameType.NOTICE, Flag.NOTICE, seq=channel.next_seq(), region_id=999, tag=1)
        with pytest.raises(TransportError, match="unknown region id 999"):
            await channel.request(notice)
    finally:
        await channel.close()


async def test_region_unregistered_mid_write_is_refused(receiver: KvReceiver) -> None:
    receiver.register_region("slot", 1 << 20)
    ep = receiver.endpoint()
    channel = await ControlChannel.open(
        ep["address"], ep["port"], name="rx", limits=Limits(), buffer_bytes=1 << 20
    )
    try:
        await channel.request(
            Header(FrameType.HELLO, seq=channel.next_seq()),
            encode(TransferHello(sender_id="s", backend="tcp")),
        )
        _, meta = await channel.request(Header(FrameType.LOOKUP, seq=channel.next_seq()), b"slot")
        info = decode(meta, RegionInfo)
        seq = channel.next_seq()
        frame = _write(seq, info.region_id, [(0, bytes(range(256)) * 1024)], tag=5)
        future = channel.expect(seq)
        await channel.send([memoryview(frame[:-1000])])
        for _ in range(100):  # let the receiver take the header and start the payload
            await asyncio.sleep(0)
        receiver.unregister_region("slot")
        new = receiver.register_region("slot", 1 << 20)  # same name, new memory
        await channel.send([memoryview(frame[-1000:])])
        with pytest.raises(TransportError, match="unregistered during the write"):
            await asyncio.wait_for(future, 5)
        assert receiver.poll("slot", 5) is None
        assert not new.view(0, 1 << 18).any()
    finally:
        await channel.close()

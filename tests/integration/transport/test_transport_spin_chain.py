"""The receiver's polling between frames of a sender with one op in flight: once the event loop has run
what a frame made ready (its notice's waiter), the receiver polls for the next frame, and after each frame
it caught it polls again, so a sender that sends its next frame as soon as the one before completes finds
the receiver awake on every frame, not on every other one (README "Hot paths")."""

from __future__ import annotations

import asyncio

from shared.protocol.codec import decode, encode
from shared.protocol.transfer import RegionInfo, TransferHello
from shared.transport import KvReceiver, TransportConfig
from shared.transport.wire import (
    HEADER_BYTES,
    RECEIVER_TYPES,
    Flag,
    FrameType,
    Header,
    Limits,
    pack,
    pack_extents,
    unpack,
)

WRITES = 8


async def _reply(reader: asyncio.StreamReader) -> bytes:
    """The next reply's meta (an error reply fails the test)."""
    header = unpack(await reader.readexactly(HEADER_BYTES), Limits(), RECEIVER_TYPES)
    meta = await reader.readexactly(header.meta_len)
    assert header.type is not FrameType.ERROR, meta
    return meta


async def test_a_sender_with_one_op_in_flight_finds_the_receiver_polling_on_every_frame() -> None:
    # a 10 ms poll: a frame this task sent is in the socket at once, the budget only absorbs a stall
    rx = KvReceiver(TransportConfig(backends=["tcp"], spin_us=10_000), receiver_id="rx-spin")
    await rx.start()
    try:
        rx.register_region("buf", 1 << 16)
        ep = rx.endpoint()
        reader, writer = await asyncio.open_connection(ep["address"], ep["port"])
        hello = encode(TransferHello(sender_id="one-at-a-time", backend="tcp"))
        writer.write(pack(Header(FrameType.HELLO, seq=1, meta_len=len(hello))) + hello)
        await _reply(reader)
        writer.write(pack(Header(FrameType.LOOKUP, seq=2, meta_len=3)) + b"buf")
        region = decode(await _reply(reader), RegionInfo)
        (conn,) = rx._connections
        hits = conn._spinner.num_hits
        for k in range(WRITES):
            header = Header(
                FrameType.WRITE,
                Flag.NOTICE,
                seq=3 + k,
                region_id=region.region_id,
                tag=k + 1,
                aux=1,
                payload_len=8,
            )
            # the frame is in the socket before this task waits: the receiver's next poll finds it
            writer.write(pack(header) + pack_extents([8 * k], [8]) + bytes([k]) * 8)
            notice = await rx.wait("buf", k + 1, timeout_s=5)
            assert notice.peer_id == "one-at-a-time"
        for _ in range(WRITES):
            await _reply(reader)  # every write acknowledged
        assert bytes(rx.region("buf").view(8 * (WRITES - 1), 8)) == bytes([WRITES - 1]) * 8
        # The handshake's two polls found nothing (this task reads their replies first), so the spinner backs
        # off and skips the poll after the first write; from the second write on, each was sent when the
        # notice before it reached its waiter, which the receiver lets run before it polls: every one caught.
        # A poll made in the readable callback itself, before the waiter ran, caught none of them.
        assert conn._spinner.num_hits - hits == WRITES - 2
        writer.close()
        await writer.wait_closed()
    finally:
        await rx.close()

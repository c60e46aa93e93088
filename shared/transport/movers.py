"""The backend seam on the sender side: a `Mover` puts one op's bytes into the remote region.

Everything else (connection, hello, region lookup, bounds, deadlines, errors, acks) is the one protocol
all backends share (`Peer`, `ControlChannel`, `ReceiverConnection`). A mover decides only how payload
bytes travel and when the notice may be sent:
- `TcpMover`: payload follows a WRITE frame on the control connection; the receiver acks once it landed;
- `ShmMover`: memcpy into the receiver's mapped segment, then a NOTICE frame (only when there is a tag);
- `RdmaMover` (rdma.py): RDMA WRITEs, the last one with an immediate, then a NOTICE frame naming it.
Movers are created by `KvSender.connect`, called only by their `Peer` (possibly for several ops at
once), and closed by `Peer.close`; they own what they map or register.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import ClassVar

from shared.errors import TransportError
from shared.protocol.transfer import RegionInfo
from shared.shm import ShmSegment
from shared.transport.channel import ControlChannel
from shared.transport.timeouts import Deadline
from shared.transport.wire import EXTENT_BYTES, HEADER_BYTES, Flag, FrameType, pack_extents, pack_fields

_NOTICE, _NOTICE_IMM = int(Flag.NOTICE), int(Flag.NOTICE | Flag.IMM)  # enum arithmetic is slow per op


@dataclass(slots=True)
class WriteOp:
    """One write/write_many/notify call, validated against the region: extents lie inside it."""

    region: RegionInfo
    offsets: list[int]
    views: list[memoryview]  # flat byte views of the callers' buffers, same order as offsets
    nbytes: int
    tag: int | None  # None: no notice
    meta: bytes = b""
    when: Deadline | None = None  # set by the Peer when the mover bounds its own waits


class Mover(abc.ABC):
    kind: ClassVar[str]
    # True: `put` bounds every wait by `op.when` itself; False: the Peer wraps it in an asyncio timeout
    bounds_its_waits: ClassVar[bool] = False

    def __init__(self, channel: ControlChannel) -> None:
        self.channel = channel

    def prepare_region(self, info: RegionInfo) -> None:  # noqa: B027 (optional hook)
        """Called once per region after its lookup, before the first put to it."""

    def forget_region(self, region_id: int) -> None:  # noqa: B027 (optional hook)
        """The region id went stale (unregistered at the receiver): drop what prepare_region made."""

    @abc.abstractmethod
    async def put(self, op: WriteOp) -> None:
        """Bytes of `op` are in the remote region (and its notice posted) when this returns."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release backend resources; the channel is closed by the Peer afterwards."""

    async def send_notice(self, op: WriteOp, *, imm: int | None = None) -> None:
        """The shared NOTICE frame (after the bytes were placed by other means); waits for its ack."""
        assert op.tag is not None
        flags = _NOTICE_IMM if imm is not None else _NOTICE
        seq = self.channel.next_seq()
        frame = pack_fields(
            FrameType.NOTICE, flags, seq, op.region.region_id, op.tag, imm or 0, len(op.meta), 0, op.nbytes
        )
        await self.channel.call(seq, [frame, op.meta], HEADER_BYTES + len(op.meta), op.when)


class TcpMover(Mover):
    kind = "tcp"
    bounds_its_waits = True

    async def put(self, op: WriteOp) -> None:
        if not op.views and op.tag is not None:
            await self.send_notice(op)
            return
        channel = self.channel
        seq = channel.next_seq()
        flags = _NOTICE if op.tag is not None else 0
        header = pack_fields(
            FrameType.WRITE,
            flags,
            seq,
            op.region.region_id,
            op.tag or 0,
            len(op.views),
            len(op.meta),
            op.nbytes,
            0,
        )
        table = pack_extents(op.offsets, [len(v) for v in op.views])
        nbytes = HEADER_BYTES + EXTENT_BYTES * len(op.views) + len(op.meta) + op.nbytes
        await channel.call(seq, [header, table, op.meta, *op.views], nbytes, op.when)


class ShmMover(Mover):
    kind = "shm"
    bounds_its_waits = True

    def __init__(self, channel: ControlChannel) -> None:
        super().__init__(channel)
        self._segments: dict[int, ShmSegment] = {}

    def prepare_region(self, info: RegionInfo) -> None:
        if info.region_id in self._segments:
            return
        if not info.shm_segment:
            raise TransportError(f"region {info.name!r} is not in shared memory", param="region")
        try:
            segment = ShmSegment.attach(info.shm_segment)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot map region {info.name!r} ({info.shm_segment}): {exc}") from None
        if segment.size < info.size_bytes:
            segment.close()
            raise TransportError(f"region {info.name!r}: segment smaller than announced", param="region")
        self._segments[info.region_id] = segment

    def forget_region(self, region_id: int) -> None:
        segment = self._segments.pop(region_id, None)
        if segment is not None:
            segment.close()

    async def put(self, op: WriteOp) -> None:
        self.channel.check()  # a receiver known to be gone gets no more bytes
        segment = self._segments.get(op.region.region_id)
        if segment is None:
            raise TransportError(f"region {op.region.name!r} is not mapped", param="region")
        target = segment.buf  # the mapping as bytes: slice assignment is one memcpy, no array objects
        for offset, view in zip(op.offsets, op.views, strict=True):
            target[offset : offset + len(view)] = view
        if op.tag is not None:
            await self.send_notice(op)

    async def close(self) -> None:
        for region_id in list(self._segments):
            with contextlib.suppress(BufferError):
                self.forget_region(region_id)

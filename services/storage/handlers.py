"""Bus handlers of the storage service: decode (done by the bus), call the read/write paths, reply."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shared.bus import MsgContext
from shared.errors import InvalidRequestError
from shared.protocol import Abort, Ack, Message
from shared.protocol.kv import (
    StorageCancel,
    StorageInfo,
    StorageInfoRequest,
    StorageReadReply,
    StorageReadRequest,
    StorageRelease,
    StorageWriteReply,
    StorageWriteRequest,
)

if TYPE_CHECKING:
    from services.storage.service import StorageService


class StorageHandlers:
    def __init__(self, service: StorageService) -> None:
        self.service = service

    async def read(self, msg: StorageReadRequest, ctx: MsgContext) -> StorageReadReply:
        self.service.report_load_now()
        try:
            lease, reason = await self.service.reader.read(msg)
        finally:
            self.service.report_load_now()
        return StorageReadReply(
            request_id=msg.request_id,
            lease_id=lease.lease_id if lease else "",
            buffer_name=self.service.buffer_name,
            buffer_epoch=self.service.buffer_epoch,
            offset=lease.offset if lease else 0,
            num_blocks=lease.num_blocks if lease else 0,
            block_bytes=msg.block_bytes,
            lease_deadline_unix_s=time.time() + lease.deadline_s - time.monotonic() if lease else 0.0,
            miss_reason=reason,
        )

    async def write(self, msg: StorageWriteRequest, ctx: MsgContext) -> StorageWriteReply:
        return await self.service.writer.write(msg)

    async def control(self, msg: Message, ctx: MsgContext) -> Message:
        reader = self.service.reader
        if isinstance(msg, StorageInfoRequest):
            return StorageInfo(
                service_id=self.service.service_id,
                node=self.service.config.node,
                buffer_name=self.service.buffer_name,
                buffer_bytes=self.service.config.buffer_bytes,
                buffer_epoch=self.service.buffer_epoch,
            )
        if isinstance(msg, StorageRelease):
            released = reader.space.release(msg.lease_id)
            self.service.report_load_now()
            return Ack(ok=released, detail="released" if released else "unknown or expired lease")
        if isinstance(msg, StorageCancel):
            num_reads, num_leases = reader.cancel(msg.request_id, drop_leases=True)
            return Ack(detail=f"cancelled {num_reads} reads, released {num_leases} leases")
        raise InvalidRequestError(f"unexpected control message {msg.KIND}")

    async def abort(self, msg: Abort, ctx: MsgContext) -> None:
        # the engine still owns leases it holds (it may be copying from them); it releases them itself
        self.service.reader.cancel(msg.request_id, drop_leases=False)

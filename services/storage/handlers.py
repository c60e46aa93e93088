"""Bus handlers of the storage service: decode (done by the bus), call the read/write paths, reply.

Reads and writes run with the request id bound for logs and in a `storage.read` / `storage.write` span
that continues the caller's trace (the engine's prefix load or block persistence).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from services.storage import metrics
from shared import logs, telemetry
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

log = logging.getLogger(__name__)


class StorageHandlers:
    def __init__(self, service: StorageService) -> None:
        self.service = service

    async def read(self, msg: StorageReadRequest, ctx: MsgContext) -> StorageReadReply:
        started = time.monotonic()
        with (
            logs.request_context(msg.request_id),
            telemetry.span("storage.read", parent=ctx.trace_parent) as s,
        ):
            self.service.report_load_now()
            try:
                lease, reason = await self.service.reader.read(msg)
            finally:
                self.service.report_load_now()
                metrics.READ_SECONDS.observe(time.monotonic() - started)
            num_blocks = lease.num_blocks if lease else 0
            if s is not None:
                s.set_attributes(_read_attributes(msg, num_blocks, reason, self.service.config.node))
            log.debug(
                "read request_id=%s blocks=%d/%d miss_reason=%s",
                msg.request_id, num_blocks, len(msg.block_hashes), reason or "-",
            )  # fmt: skip
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
        with (
            logs.request_context(msg.request_id),
            telemetry.span("storage.write", parent=ctx.trace_parent) as s,
        ):
            reply = await self.service.writer.write(msg)
            if s is not None:
                s.set_attributes(
                    {
                        "request_id": msg.request_id,
                        "node": self.service.config.node,
                        "num_blocks": len(msg.block_hashes),
                        "num_written": reply.num_written,
                    }
                )
            log.debug("write request_id=%s blocks=%d", msg.request_id, len(msg.block_hashes))
            return reply

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


def _read_attributes(msg: StorageReadRequest, num_blocks: int, reason: str, node: int) -> dict[str, Any]:
    return {
        "request_id": msg.request_id,
        "node": node,
        "num_blocks_requested": len(msg.block_hashes),
        "num_blocks": num_blocks,
        "bytes": num_blocks * msg.block_bytes,
        "miss_reason": reason,
    }

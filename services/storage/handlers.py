"""Bus handlers of the storage service: decode (done by the bus), call the read/write paths, reply.

Reads and writes run with the request id bound for logs and in a `storage.read` / `storage.write` span
that continues the caller's trace (the engine's prefix load or block persistence).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from services.storage import metrics
from services.storage.reader import BlockReader
from services.storage.writer import BlockWriter
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

log = logging.getLogger(__name__)


class StorageHandlers:
    """Takes the read and write paths, what the node buffer is (`info`), and a callback for load changes."""

    def __init__(
        self, reader: BlockReader, writer: BlockWriter, info: StorageInfo, on_load_change: Callable[[], None]
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.info = info
        self.on_load_change = on_load_change

    async def read(self, msg: StorageReadRequest, ctx: MsgContext) -> StorageReadReply:
        started = time.monotonic()
        with (
            logs.request_context(msg.request_id),
            telemetry.span("storage.read", parent=ctx.trace_parent) as s,
        ):
            self.on_load_change()
            try:
                lease, reason = await self.reader.read(msg)
            finally:
                self.on_load_change()
                metrics.READ_SECONDS.observe(time.monotonic() - started)
            num_blocks = lease.num_blocks if lease else 0
            if s is not None:
                s.set_attributes(_read_attributes(msg, num_blocks, reason, self.info.node))
            log.debug(
                "read request_id=%s blocks=%d/%d miss_reason=%s",
                msg.request_id, num_blocks, len(msg.block_hashes), reason or "-",
            )  # fmt: skip
        return StorageReadReply(
            request_id=msg.request_id,
            lease_id=lease.lease_id if lease else "",
            buffer_name=self.info.buffer_name,
            buffer_epoch=self.info.buffer_epoch,
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
            reply = await self.writer.write(msg)
            if s is not None:
                s.set_attributes(
                    {
                        "request_id": msg.request_id,
                        "node": self.info.node,
                        "num_blocks": len(msg.block_hashes),
                        "num_written": reply.num_written,
                    }
                )
            log.debug("write request_id=%s blocks=%d", msg.request_id, len(msg.block_hashes))
            return reply

    async def control(self, msg: Message, ctx: MsgContext) -> Message:
        reader = self.reader
        if isinstance(msg, StorageInfoRequest):
            return self.info
        if isinstance(msg, StorageRelease):
            released = reader.space.release(msg.lease_id)
            self.on_load_change()
            return Ack(ok=released, detail="released" if released else "unknown or expired lease")
        if isinstance(msg, StorageCancel):
            num_reads, num_leases = reader.cancel(msg.request_id, drop_leases=True)
            return Ack(detail=f"cancelled {num_reads} reads, released {num_leases} leases")
        raise InvalidRequestError(f"unexpected control message {msg.KIND}")

    async def abort(self, msg: Abort, ctx: MsgContext) -> None:
        # the engine still owns leases it holds (it may be copying from them); it releases them itself
        self.reader.cancel(msg.request_id, drop_leases=False)


def _read_attributes(msg: StorageReadRequest, num_blocks: int, reason: str, node: int) -> dict[str, Any]:
    return {
        "request_id": msg.request_id,
        "node": node,
        "num_blocks_requested": len(msg.block_hashes),
        "num_blocks": num_blocks,
        "bytes": num_blocks * msg.block_bytes,
        "miss_reason": reason,
    }

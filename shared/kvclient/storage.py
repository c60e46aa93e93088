"""A node's storage service as engines use it: leased reads into the node buffer, writes from a staging
segment."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.blocks import BlockLayout, ExtentAllocator, layer_view
from shared.bus import Bus
from shared.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KvpathError,
    OverloadedError,
    ServiceUnavailableError,
)
from shared.protocol import Ack, check_token
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
from shared.shm import ShmSegment

log = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 2.0
_OVERLOADED_FIRST_BACK_OFF_S = 0.02  # a write refused by a full queue is asked again after this, doubling
_OVERLOADED_MAX_BACK_OFF_S = 0.5
RESTART_GRACE_S = 10.0  # writes wait this long for a storage service none answers for (a restart)


@dataclass(slots=True, eq=False)
class ReadLease:
    """Blocks read into the node buffer, leased to one request until `release()` (or the lease expires).

    `views[i, l]` is layer l of block i, a view into shared memory: no copy. Use them only before release.
    """

    request_id: str
    lease_id: str
    num_blocks: int
    views: np.ndarray  # uint8 [num_blocks, num_layers, block_size, bytes]
    miss_reason: str = ""
    _client: StorageClient | None = None

    def layer(self, layer: int) -> np.ndarray:
        """Layer `layer` of every leased block: `[num_blocks, block_size, bytes]`."""
        return layer_view(self.views, layer)

    async def release(self) -> None:
        """Give the buffer space back (idempotent). Views must not be used afterwards."""
        client, self._client = self._client, None
        self.views = self.views[:0]
        if client is not None and self.lease_id:
            await client._release(self.lease_id)

    async def __aenter__(self) -> ReadLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


@dataclass(slots=True, eq=False)
class StagedBlocks:
    """Space for `num_blocks` Full Blocks in the client's staging segment; fill `views`, then `write()`."""

    offset: int
    num_blocks: int
    views: np.ndarray  # uint8 [num_blocks, num_layers, block_size, bytes]


@dataclass(slots=True, frozen=True)
class WriteResult:
    num_written: int
    num_existing: int
    event_stream_seq: int  # the BlockStored event's stream sequence (0: none published)


class StorageClient:
    """One engine's handle on its node's storage service (see the module docstring)."""

    def __init__(
        self,
        bus: Bus,
        node: int,
        layout: BlockLayout,
        fingerprint: str,
        *,
        staging_bytes: int = 64 * 1024 * 1024,
        lease_s: float = 0.0,
        owner_id: str = "",
    ) -> None:
        """`owner_id` (e.g. the engine's service id) names the staging segment, so a restarted engine
        replaces the segment its crashed predecessor left in /dev/shm; empty: a random name."""
        if not fingerprint:
            raise ValueError("fingerprint must not be empty")
        self.bus = bus
        self.node = node
        self.layout = layout
        self.fingerprint = fingerprint
        self.lease_s = lease_s
        self.owner_id = owner_id
        self.staging_bytes = max(staging_bytes, layout.full_block_bytes)
        self._staging: ShmSegment | None = None
        self._staging_array: np.ndarray | None = None
        self._staging_alloc: ExtentAllocator | None = None
        self._buffer: ShmSegment | None = None
        self._buffer_array: np.ndarray | None = None
        self._buffer_key: tuple[str, int] = ("", 0)
        self._quarantine: set[asyncio.TimerHandle] = set()
        self._down_since: float | None = None  # since when writes found no storage service answering

    async def start(self) -> None:
        """Create the staging segment and map the node buffer (mapped later if storage is not up yet)."""
        if self._staging is None:
            owner = check_token(self.owner_id or uuid.uuid4().hex[:12], "owner_id")
            name = f"kvpath-{self.bus.subjects.namespace}-stage-{owner}"
            self._staging = ShmSegment.create(name, self.staging_bytes, replace=bool(self.owner_id))
            self._staging_array = self._staging.array()
            self._staging_alloc = ExtentAllocator(self.staging_bytes)
        try:
            info = await self.info(timeout_s=_CONTROL_TIMEOUT_S)
            self._map_buffer(info.buffer_name, info.buffer_epoch)
        except KvpathError as exc:
            log.warning("storage node=%s not reachable yet: %s", self.node, exc.message)

    async def close(self) -> None:
        for handle in self._quarantine:
            handle.cancel()
        self._quarantine.clear()
        self._staging_array = self._buffer_array = None
        for seg in (self._staging, self._buffer):
            if seg is not None:
                seg.close()
        self._staging = self._buffer = None

    async def info(self, *, timeout_s: float | None = None) -> StorageInfo:
        return await self.bus.request(
            self.bus.subjects.storage_control(self.node),
            StorageInfoRequest(),
            StorageInfo,
            timeout_s=timeout_s,
        )

    # ------------------------------------------------------------------------------------------ read

    async def read(
        self, request_id: str, block_hashes: Sequence[int], *, deadline_s: float, lease_s: float | None = None
    ) -> ReadLease:
        """Read the blocks into the node buffer; `deadline_s` is the time budget in seconds from now.

        Returns the verified leading blocks (fewer than asked when one is missing or corrupt).
        """
        if deadline_s <= 0 or deadline_s > 1e6:
            raise InvalidRequestError(
                f"deadline_s must be seconds from now, got {deadline_s}", param="deadline_s"
            )
        if not block_hashes:
            return ReadLease(request_id, "", 0, self.layout.empty_blocks(0))
        msg = StorageReadRequest(
            request_id=request_id,
            fingerprint=self.fingerprint,
            block_hashes=[int(h) for h in block_hashes],
            block_bytes=self.layout.full_block_bytes,
            block_tokens=self.layout.block_size,
            timeout_s=max(0.01, deadline_s * 0.95),
            lease_s=self.lease_s if lease_s is None else lease_s,
        )
        try:
            reply = await self.bus.request(
                self.bus.subjects.storage_read(self.node), msg, StorageReadReply, timeout_s=deadline_s
            )
        except DeadlineExceededError:
            await self.cancel(request_id)
            raise
        if reply.num_blocks == 0:
            return ReadLease(request_id, "", 0, self.layout.empty_blocks(0), reply.miss_reason)
        try:
            buffer = self._map_buffer(reply.buffer_name, reply.buffer_epoch)
            views = self.layout.full_blocks_view(buffer, reply.offset, reply.num_blocks)
        except (OSError, ValueError) as exc:
            await self._release(reply.lease_id)
            raise ServiceUnavailableError(f"cannot map node buffer {reply.buffer_name}: {exc}") from exc
        return ReadLease(request_id, reply.lease_id, reply.num_blocks, views, reply.miss_reason, self)

    async def cancel(self, request_id: str) -> None:
        """Stop the request's reads and drop its leases (best effort, bounded wait)."""
        subject = self.bus.subjects.storage_control(self.node)
        with contextlib.suppress(KvpathError):
            await self.bus.request(
                subject, StorageCancel(request_id=request_id), Ack, timeout_s=_CONTROL_TIMEOUT_S
            )

    async def _release(self, lease_id: str) -> None:
        subject = self.bus.subjects.storage_control(self.node)
        try:
            await self.bus.request(
                subject, StorageRelease(lease_id=lease_id), Ack, timeout_s=_CONTROL_TIMEOUT_S
            )
        except KvpathError as exc:  # the lease expires on its own
            log.warning("lease release failed lease=%s: %s", lease_id, exc.message)

    def _map_buffer(self, name: str, epoch: int) -> np.ndarray:
        if self._buffer_array is None or self._buffer_key != (name, epoch):
            if self._buffer is not None:
                self._buffer.close()
            self._buffer = None
            self._buffer = ShmSegment.attach(name)
            self._buffer_array = self._buffer.array()
            self._buffer_key = (name, epoch)
        return self._buffer_array

    # ----------------------------------------------------------------------------------------- write

    def stage(self, num_blocks: int) -> StagedBlocks:
        """Reserve staging space for `num_blocks` blocks. OverloadedError when the staging segment is full."""
        if self._staging_alloc is None or self._staging_array is None:
            raise ServiceUnavailableError("StorageClient not started")
        if num_blocks <= 0:
            raise InvalidRequestError(f"num_blocks must be > 0, got {num_blocks}", param="num_blocks")
        offset = self._staging_alloc.allocate(self.layout.blocks_bytes(num_blocks))
        if offset is None:
            raise OverloadedError(
                f"staging segment full ({self.staging_bytes} B): cannot stage {num_blocks} blocks"
            )
        views = self.layout.full_blocks_view(self._staging_array, offset, num_blocks)
        return StagedBlocks(offset, num_blocks, views)

    def stage_up_to(self, num_blocks: int) -> StagedBlocks | None:
        """Stage as many of `num_blocks` blocks as one free extent of the staging segment holds now (the
        leading ones of a larger write; the rest once earlier writes free space); None when not one fits."""
        if self._staging_alloc is None:
            raise ServiceUnavailableError("StorageClient not started")
        fit = min(num_blocks, self._staging_alloc.largest_free_bytes // self.layout.full_block_bytes)
        return self.stage(fit) if fit > 0 else None

    def unstage(self, staged: StagedBlocks) -> None:
        if self._staging_alloc is not None and staged.num_blocks:
            self._staging_alloc.free(staged.offset)
            staged.num_blocks = 0
            staged.views = staged.views[:0]

    async def write(
        self,
        staged: StagedBlocks,
        block_hashes: Sequence[int],
        parent_hashes: Sequence[int],
        *,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> WriteResult:
        """Persist the staged blocks; returns once they are durable and announced. Frees the staging space.

        A node whose write queue is full (OverloadedError: it refused before reading anything) or that has
        no storage service answering (ServiceUnavailableError: it restarts) is asked again after a back-off
        (20 ms, doubling, at most 0.5 s) until `timeout_s` runs out, the staged bytes kept meanwhile (the
        staging segment is the client's, so a restarted service reads them as well): a burst of finished
        requests waits its turn, and the writes of a storage restart (~1.5 s under `kvpath up`) land,
        instead of losing their KV.
        Raises StorageError (storage full, I/O error), OverloadedError (still refused at the deadline) or
        ServiceUnavailable/DeadlineExceeded; the engine keeps serving either way.
        """
        loop = asyncio.get_running_loop()
        timeout = timeout_s or self.bus.request_timeout_s
        deadline, back_off = loop.time() + timeout, _OVERLOADED_FIRST_BACK_OFF_S
        request_id = request_id or uuid.uuid4().hex
        subject = self.bus.subjects.storage_write(self.node)
        while True:
            remaining = max(deadline - loop.time(), 1e-3)
            msg = self._write_request(staged, block_hashes, parent_hashes, request_id, remaining)
            try:
                reply = await self.bus.request(subject, msg, StorageWriteReply, timeout_s=remaining)
                break
            except (DeadlineExceededError, asyncio.CancelledError):
                self._free_later(staged, remaining)  # the service may still be reading the staged bytes
                raise
            except (OverloadedError, ServiceUnavailableError) as exc:
                if deadline - loop.time() <= back_off or self._is_down_for_long(exc, loop.time()):
                    self.unstage(staged)
                    raise
            except KvpathError:
                self.unstage(staged)
                raise
            try:
                await asyncio.sleep(back_off)  # nothing in flight: the staged bytes are ours
            except asyncio.CancelledError:
                self.unstage(staged)
                raise
            back_off = min(2 * back_off, _OVERLOADED_MAX_BACK_OFF_S)
        self._down_since = None
        self.unstage(staged)
        return WriteResult(reply.num_written, reply.num_existing, reply.event_stream_seq)

    def _is_down_for_long(self, exc: KvpathError, now: float) -> bool:
        """Whether no storage service has answered for over RESTART_GRACE_S (`exc` being the refusal just
        got): a restart is waited for, a node down for good fails writes at once again (a finishing
        request waits for its writes, so each would wait out its timeout)."""
        if not isinstance(exc, ServiceUnavailableError):
            return False
        if self._down_since is None:
            self._down_since = now
        return now - self._down_since > RESTART_GRACE_S

    def _write_request(
        self,
        staged: StagedBlocks,
        block_hashes: Sequence[int],
        parent_hashes: Sequence[int],
        request_id: str,
        timeout_s: float,
    ) -> StorageWriteRequest:
        if self._staging is None:
            raise ServiceUnavailableError("StorageClient not started")
        if not len(block_hashes) == len(parent_hashes) == staged.num_blocks:
            raise InvalidRequestError(
                f"{staged.num_blocks} staged blocks, {len(block_hashes)} hashes, {len(parent_hashes)} parents"
            )
        block_bytes = self.layout.full_block_bytes
        return StorageWriteRequest(
            request_id=request_id,
            fingerprint=self.fingerprint,
            segment_name=self._staging.name,
            offsets=[staged.offset + i * block_bytes for i in range(staged.num_blocks)],
            block_bytes=block_bytes,
            block_hashes=[int(h) for h in block_hashes],
            parent_hashes=[int(h) for h in parent_hashes],
            block_tokens=self.layout.block_size,
            timeout_s=timeout_s,
        )

    def _free_later(self, staged: StagedBlocks, delay_s: float) -> None:
        loop = asyncio.get_running_loop()

        def free() -> None:
            self._quarantine.discard(handle)
            self.unstage(staged)

        handle = loop.call_later(delay_s, free)
        self._quarantine.add(handle)

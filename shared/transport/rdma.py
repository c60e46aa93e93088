"""The rdma backend: RC queue pairs, RDMA WRITE, and WRITE WITH IMMEDIATE for the notice.

Connection setup rides on the shared control connection: the sender's HELLO carries its queue pair
(qpn, psn, lid, gid, mtu), the receiver creates one per connection and answers in WELCOME; a region
lookup returns the region's address and rkey. A write posts one chain of RDMA WRITEs; with a tag the
last one carries an immediate `k`, and after its completion the sender sends NOTICE(IMM, aux=k) on the
control connection. The receiver posts that notice only once it has polled the immediate `k` from its
queue pair, which RC ordering guarantees comes after every byte of the chain is visible. The immediate
only joins the two; region, tag and meta travel on the control connection, so tags stay full u32.

Sources must be registered memory: `KvSender.register_memory` pre-registers big buffers; any other
source is registered for the duration of one write (correct, slower). Untested on this machine (no RDMA
device here); tests marked `rdma` run it where a device exists.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
from typing import Any

from shared.errors import TransportError
from shared.protocol.transfer import RdmaQpInfo, RegionInfo
from shared.transport.channel import ControlChannel
from shared.transport.config import TransportConfig
from shared.transport.movers import Mover, WriteOp
from shared.transport.rdma_verbs import RcQueuePair, RdmaDevice, buffer_address, load_pyverbs, split_pieces
from shared.transport.region import Region
from shared.transport.sockio import as_bytes_view
from shared.transport.wire import U32_MAX

log = logging.getLogger(__name__)


@functools.cache
def rdma_available(device: str = "", port: int = 1) -> tuple[bool, str]:
    """(True, device name) when pyverbs imports and an active RDMA port exists, else (False, why not)."""
    try:
        verbs = load_pyverbs()
    except ImportError as exc:
        return False, f"pyverbs cannot be imported: {exc}"
    try:
        names = [d.name.decode() for d in verbs.device.get_device_list()]
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when the list cannot be read
        return False, f"no RDMA device listed ({exc})"
    if not names:
        return False, "no RDMA device listed"
    name = device or names[0]
    if name not in names:
        return False, f"RDMA device {name!r} not found (devices: {names})"
    try:
        ctx = verbs.device.Context(name=name)
        try:
            state = ctx.query_port(port).state
        finally:
            ctx.close()
    except Exception as exc:
        return False, f"RDMA device {name} cannot be opened: {exc}"
    if state != verbs.enums.IBV_PORT_ACTIVE:
        return False, f"RDMA device {name} port {port} is not active"
    return True, name


class RdmaReceiverSide:
    """Receiver's device: regions registered for remote write, one queue pair per rdma connection."""

    def __init__(self, device: RdmaDevice) -> None:
        self.device = device
        self.device_name = device.name

    @classmethod
    def open(cls, config: TransportConfig) -> RdmaReceiverSide:
        return cls(RdmaDevice(load_pyverbs(), config))

    def register_region(self, region: Region) -> None:
        region.rdma_key = self.device.register(region.address(), region.size_bytes, remote_write=True)

    def deregister_region(self, region: Region) -> None:
        if region.rdma_key is not None:
            region.rdma_key.close()  # type: ignore[attr-defined]
            region.rdma_key = None

    def region_keys(self, region: Region) -> tuple[int, int]:
        if region.rdma_key is None:
            return 0, 0
        return region.address(), int(region.rdma_key.rkey)  # type: ignore[attr-defined]

    def accept(self, conn: Any, remote: RdmaQpInfo) -> RdmaQpInfo:
        queue_pair = RcQueuePair(self.device)
        try:
            queue_pair.post_receives(queue_pair.depth)
            queue_pair.connect(remote)
        except Exception as exc:
            queue_pair.close()
            raise TransportError(f"cannot connect RDMA queue pair: {exc}") from None
        conn.rdma = queue_pair
        return queue_pair.local_info()

    async def join_immediate(self, conn: Any, imm: int) -> None:
        queue_pair: RcQueuePair = conn.rdma
        await queue_pair.wait_immediate(imm)

    def release(self, conn: Any) -> None:
        queue_pair, conn.rdma = conn.rdma, None
        if queue_pair is not None:
            try:
                queue_pair.close()
            except Exception:
                log.exception("kv receiver: could not destroy the RDMA queue pair of %s", conn.peer_id)

    def close(self) -> None:
        self.device.close()


class RdmaSenderSide:
    """Sender's device: source memory registrations shared by its queue pairs (one per Peer)."""

    def __init__(self, device: RdmaDevice) -> None:
        self.device = device
        self._starts: list[int] = []  # sorted start addresses of registered sources
        self._sources: list[tuple[int, int, Any, Any]] = []  # (start, end, MR, owner object kept alive)

    @classmethod
    def open(cls, config: TransportConfig) -> RdmaSenderSide:
        return cls(RdmaDevice(load_pyverbs(), config))

    def register_memory(self, data: Any) -> None:
        view = as_bytes_view(data)
        start = buffer_address(view)
        mr = self.device.register(start, len(view), remote_write=False)
        index = bisect.bisect(self._starts, start)
        self._starts.insert(index, start)
        self._sources.insert(index, (start, start + len(view), mr, data))

    def lkey_for(self, address: int, length: int) -> int | None:
        """lkey of a registered source that holds [address, address+length), if any."""
        index = bisect.bisect(self._starts, address) - 1
        if index >= 0:
            start, end, mr, _ = self._sources[index]
            if start <= address and address + length <= end:
                return int(mr.lkey)
        return None

    def new_queue_pair(self) -> RcQueuePair:
        return RcQueuePair(self.device)

    def mover(self, channel: ControlChannel, queue_pair: RcQueuePair) -> RdmaMover:
        return RdmaMover(channel, self, queue_pair)

    def close(self) -> None:
        for _, _, mr, _ in self._sources:
            mr.close()
        self._starts.clear()
        self._sources.clear()
        self.device.close()


class RdmaMover(Mover):
    kind = "rdma"

    def __init__(self, channel: ControlChannel, side: RdmaSenderSide, queue_pair: RcQueuePair) -> None:
        super().__init__(channel)
        self._side = side
        self._qp = queue_pair
        self._lock = asyncio.Lock()  # one chain in flight per queue pair keeps the bookkeeping simple
        self._credits = asyncio.Semaphore(queue_pair.depth // 2)  # immediates not yet acked <= receive slots
        self._batch = max(1, queue_pair.depth // 2)
        self._imm = 0
        self._wr_id = 0

    def prepare_region(self, info: RegionInfo) -> None:
        if not info.rdma_rkey or not info.rdma_addr:
            raise TransportError(f"region {info.name!r} is not registered for RDMA", param="region")

    async def put(self, op: WriteOp) -> None:
        self.channel.check()
        if op.tag is None:
            async with self._lock:
                await self._write(op, None)
            return
        async with self._credits:
            self._imm = (self._imm + 1) & U32_MAX
            imm = self._imm
            async with self._lock:
                await self._write(op, imm)
            await self.send_notice(op, imm=imm)

    async def _write(self, op: WriteOp, imm: int | None) -> None:
        temporaries: list[Any] = []
        try:
            pieces = self._pieces(op, temporaries)
            batches = [pieces[i : i + self._batch] for i in range(0, len(pieces), self._batch)]
            for number, batch in enumerate(batches):
                self._wr_id = (self._wr_id + 1) & 0xFFFFFFFFFFFF
                is_last = number == len(batches) - 1
                self._qp.post_writes(batch, imm=imm if is_last else None, wr_id=self._wr_id)
                await self._qp.wait_send(self._wr_id)
        except TransportError as exc:
            self.channel.break_(f"RDMA write failed: {exc.message}")
            raise
        except BaseException:
            # deadline or cancellation with work requests in flight: flush them before their memory goes
            try:
                self._qp.to_error()
            except Exception:
                log.exception("kv sender: could not move the RDMA queue pair to the error state")
            self.channel.break_("RDMA write interrupted; queue pair flushed")
            raise
        finally:
            for mr in temporaries:
                mr.close()

    def _pieces(self, op: WriteOp, temporaries: list[Any]) -> list[tuple[int, int, int, int, int]]:
        region = op.region
        pieces: list[tuple[int, int, int, int, int]] = []
        for offset, view in zip(op.offsets, op.views, strict=True):
            if not len(view):
                continue
            address = buffer_address(view)
            lkey = self._side.lkey_for(address, len(view))
            if lkey is None:
                mr = self._side.device.register(address, max(len(view), 1), remote_write=False)
                temporaries.append(mr)
                lkey = int(mr.lkey)
            pieces += split_pieces(address, len(view), lkey, region.rdma_addr + offset, region.rdma_rkey)
        if not pieces:  # a bare notice: zero-length write that carries the immediate
            scratch = self._qp.scratch
            pieces.append((int(scratch.buf), 0, int(scratch.lkey), region.rdma_addr, region.rdma_rkey))
        return pieces

    async def close(self) -> None:
        self._qp.close()

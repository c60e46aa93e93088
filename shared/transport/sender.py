"""`KvSender` and `Peer`: one-sided writes into a remote receiver's regions, then a completion notice.

Who calls what: an engine keeps one `KvSender` (its `sender_id` is what receivers' `wait(peer_id=...)`
name) and one `Peer` per receiver it talks to, made by `connect(endpoint)` from the receiver's registry
entry and kept for as long as it owes that receiver notices. Every call takes `timeout_s`; a deadline
gives DeadlineExceededError, a lost receiver or a refused write TransportError. A deadline that fires
while a tcp payload is half sent breaks that Peer (the stream holds a partial frame): reconnect.
Who frees what: the caller keeps its source buffers alive and unchanged until the call returns; the
Peer owns its connection, mappings and RDMA resources until `close()`; the sender closes leftover peers.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from shared.errors import TransportError
from shared.protocol.codec import decode, encode
from shared.protocol.transfer import KvEndpoint, RegionInfo, TransferHello, TransferWelcome
from shared.transport.channel import ControlChannel
from shared.transport.config import TransportConfig
from shared.transport.endpoint import LocalCaps, host_id, parse_endpoint, probe_shm, select_backend
from shared.transport.movers import Mover, ShmMover, TcpMover, WriteOp
from shared.transport.segments import is_control_socket_path
from shared.transport.sockio import as_bytes_view
from shared.transport.timeouts import Deadline, deadline
from shared.transport.wire import FrameType, Header, Limits, check_tag, pack

log = logging.getLogger(__name__)


class Peer:
    """A connection to one receiver over one backend."""

    def __init__(self, remote: KvEndpoint, channel: ControlChannel, mover: Mover, limits: Limits) -> None:
        self.receiver_id = remote.receiver_id
        self.backend = mover.kind
        self.control = channel.kind  # "unix" (an shm peer on the receiver's Unix socket) or "tcp"
        self._channel = channel
        self._mover = mover
        self._limits = limits
        self._regions: dict[str, RegionInfo] = {}
        self._lookup_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self._closed = False

    @property
    def is_open(self) -> bool:
        return not self._closed and not self._channel.is_broken

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def region_info(self, region: str, *, timeout_s: float) -> RegionInfo:
        async with deadline(timeout_s, f"look up region {region!r} at {self.receiver_id}"):
            return await self._lookup(region)

    async def write(
        self,
        region: str,
        offset: int,
        data: Any,
        *,
        tag: int | None = None,
        meta: bytes = b"",
        timeout_s: float,
    ) -> None:
        """Put `data` (any C-contiguous buffer) at `offset` of `region`; then post notice `tag` if given."""
        await self.write_many(region, [(offset, data)], tag=tag, meta=meta, timeout_s=timeout_s)

    async def write_many(
        self,
        region: str,
        extents: Sequence[tuple[int, Any]],
        *,
        tag: int | None = None,
        meta: bytes = b"",
        timeout_s: float,
    ) -> None:
        """Scatter `(offset, data)` pieces into `region` in one op, one notice at the end (if `tag`)."""
        mover = self._mover
        when = Deadline(timeout_s, f"write to {self.receiver_id}/{region}", self._loop.time())
        info = self._regions.get(region)
        if info is None or self._closed:
            async with deadline(when.remaining_s(), when.what):
                info = await self._lookup(region)
        op = self._make_op(info, extents, tag, meta)
        try:
            if mover.bounds_its_waits:  # the hot path: no asyncio timeout, one timer per channel
                op.when = when
                await mover.put(op)
            else:
                async with deadline(when.remaining_s(), when.what):
                    await mover.put(op)
        except TransportError as exc:
            if exc.param == "region":  # unregistered there: look it up again next time
                self._regions.pop(region, None)
                mover.forget_region(info.region_id)
            raise

    async def notify(self, region: str, tag: int, meta: bytes = b"", *, timeout_s: float) -> None:
        """Post a notice with no bytes of its own (after earlier writes, whose bytes it then covers)."""
        await self.write_many(region, [], tag=tag, meta=meta, timeout_s=timeout_s)

    async def close(self) -> None:
        """Say goodbye and release the connection and backend resources. Idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._mover.close()
        finally:
            await self._channel.close(bye=pack(Header(FrameType.BYE)))

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _lookup(self, region: str) -> RegionInfo:
        if self._closed:
            raise TransportError(f"peer {self.receiver_id} is closed")
        info = self._regions.get(region)
        if info is not None:
            return info
        async with self._lookup_lock:
            info = self._regions.get(region)
            if info is None:
                header = Header(FrameType.LOOKUP, seq=self._channel.next_seq())
                _, meta = await self._channel.request(header, region.encode())
                info = decode(meta, RegionInfo)
                self._mover.prepare_region(info)
                self._regions[region] = info
            return info

    def _make_op(
        self, info: RegionInfo, extents: Sequence[tuple[int, Any]], tag: int | None, meta: bytes
    ) -> WriteOp:
        if tag is None and (meta or not extents):
            raise TransportError("meta needs a tag, and a write with no extents needs a tag", param="tag")
        if tag is not None:
            check_tag(tag)
        if len(meta) > self._limits.max_meta_bytes:
            raise TransportError(
                f"meta of {len(meta)} bytes exceeds {self._limits.max_meta_bytes}", param="meta"
            )
        if len(extents) > self._limits.max_extents:
            raise TransportError(f"{len(extents)} extents exceed {self._limits.max_extents}", param="extents")
        offsets, views = [], []
        for offset, data in extents:
            try:
                view = as_bytes_view(data)
            except (TypeError, ValueError) as exc:
                raise TransportError(f"cannot send {type(data).__name__}: {exc}", param="data") from None
            if offset < 0 or offset + len(view) > info.size_bytes:
                raise TransportError(
                    f"extent [{offset}, {offset + len(view)}) is outside region {info.name!r} "
                    f"({info.size_bytes} bytes)",
                    param="offset",
                )
            offsets.append(offset)
            views.append(view)
        nbytes = sum(len(v) for v in views)
        if nbytes > self._limits.max_payload_bytes:
            raise TransportError(
                f"write of {nbytes} bytes exceeds {self._limits.max_payload_bytes}", param="data"
            )
        return WriteOp(info, offsets, views, nbytes, tag, meta)


class KvSender:
    """Makes peers; one per engine process. `sender_id` identifies it to receivers."""

    def __init__(self, config: TransportConfig | None = None, *, sender_id: str = "") -> None:
        self.config = config or TransportConfig()
        self.config.validate()
        self.sender_id = sender_id or "tx-" + uuid.uuid4().hex[:12]
        self.limits = Limits(
            self.config.max_meta_bytes, self.config.max_extents_per_write, self.config.max_write_bytes
        )
        self._peers: set[Peer] = set()
        self._rdma: Any = None  # RdmaSenderSide, opened on first use
        self._rdma_checked: tuple[bool, str] | None = None

    def local_caps(self) -> LocalCaps:
        backends = [b for b in self.config.backends if b != "rdma" or self._rdma_usable()]
        return LocalCaps(host_id(), tuple(backends))

    def _rdma_usable(self) -> bool:
        if self._rdma_checked is None:
            import shared.transport.rdma as rdma  # lazy: pyverbs is optional

            self._rdma_checked = rdma.rdma_available(self.config.rdma_device)
        return self._rdma_checked[0]

    def _rdma_side(self) -> Any:
        if self._rdma is None:
            import shared.transport.rdma as rdma

            self._rdma = rdma.RdmaSenderSide.open(self.config)
        return self._rdma

    def register_memory(self, data: Any) -> None:
        """RDMA: pre-register a large source buffer (e.g. a node DRAM buffer) so writes from any part of
        it skip per-write memory registration. A no-op without RDMA. Keep `data` alive until close()."""
        if "rdma" in self.config.backends and self._rdma_usable():
            self._rdma_side().register_memory(data)

    async def connect(
        self, endpoint: dict[str, Any] | KvEndpoint, *, timeout_s: float, backend: str | None = None
    ) -> Peer:
        """Connect to a receiver's endpoint over the best usable backend, or over `backend` if usable."""
        remote = parse_endpoint(endpoint)
        async with deadline(timeout_s, f"connect to KV receiver {remote.receiver_id}"):
            choice = self._choose(remote, backend)
            channel = await self._open_channel(remote, choice)
            try:
                mover = await self._handshake(channel, remote, choice)
            except BaseException:
                await channel.close()
                raise
        peer = Peer(remote, channel, mover, self.limits)
        self._peers = {p for p in self._peers if not p.is_closed}
        self._peers.add(peer)
        log.info(
            "kv sender %s: connected to %s over %s (control: %s)",
            self.sender_id,
            remote.receiver_id,
            choice,
            peer.control,
        )
        return peer

    async def _open_channel(self, remote: KvEndpoint, choice: str) -> ControlChannel:
        """The control connection: the receiver's Unix socket for shm (a notice and its ack cost two Unix
        sends instead of two trips through loopback TCP), else its TCP port."""
        name, limits = remote.receiver_id, self.limits
        buffer_bytes, spin_s = self.config.socket_buffer_bytes, self.config.spin_us * 1e-6
        if choice == "shm" and remote.shm_socket and not is_control_socket_path(remote.shm_socket):
            log.warning("kv sender %s: ignoring shm_socket %r of %s", self.sender_id, remote.shm_socket, name)
        elif choice == "shm" and remote.shm_socket:
            try:
                return await ControlChannel.open_unix(
                    remote.shm_socket, name=name, limits=limits, buffer_bytes=buffer_bytes, spin_s=spin_s
                )
            except TransportError as exc:
                log.info("kv sender %s: %s; connecting over tcp", self.sender_id, exc.message)
        return await ControlChannel.open(
            remote.address, remote.port, name=name, limits=limits, buffer_bytes=buffer_bytes, spin_s=spin_s
        )

    def _choose(self, remote: KvEndpoint, forced: str | None) -> str:
        local = self.local_caps()
        choice = select_backend(local, remote, forced=forced)
        if choice == "shm" and not probe_shm(remote):
            if forced == "shm":
                raise TransportError(f"shm forced but receiver {remote.receiver_id}'s probe cannot be mapped")
            log.info(
                "kv sender: same host id as %s but its shm probe is not visible; not using shm",
                remote.receiver_id,
            )
            local = LocalCaps(local.host_id, tuple(b for b in local.backends if b != "shm"))
            choice = select_backend(local, remote)
        return choice

    async def _handshake(self, channel: ControlChannel, remote: KvEndpoint, choice: str) -> Mover:
        queue_pair = self._rdma_side().new_queue_pair() if choice == "rdma" else None
        try:
            hello = TransferHello(
                sender_id=self.sender_id,
                backend=choice,
                host_id=host_id(),
                rdma=queue_pair.local_info() if queue_pair is not None else None,
            )
            header = Header(FrameType.HELLO, seq=channel.next_seq())
            _, meta = await channel.request(header, encode(hello))
            welcome = decode(meta, TransferWelcome)
            if welcome.backend != choice:
                raise TransportError(f"receiver answered backend {welcome.backend!r}, asked {choice!r}")
            if queue_pair is not None:
                if welcome.rdma is None:
                    raise TransportError("receiver accepted rdma without queue pair info")
                queue_pair.connect(welcome.rdma)
                return self._rdma_side().mover(channel, queue_pair)  # type: ignore[no-any-return]
        except BaseException:
            if queue_pair is not None:
                queue_pair.close()
            raise
        return ShmMover(channel) if choice == "shm" else TcpMover(channel)

    async def close(self) -> None:
        """Close every peer this sender made, then RDMA resources."""
        peers, self._peers = self._peers, set()
        for peer in peers:
            await peer.close()
        if self._rdma is not None:
            self._rdma.close()
            self._rdma = None

"""`KvReceiver`: owns receive regions, serves control connections, hands out completion notices.

Who calls what (one receiver per engine process):
- the engine: `start()` once, `register_region()` for its receive buffers, announces `endpoint()` in its
  registry entry (ServiceInfo.extra["kv_endpoint"]), then per transfer `wait(region, tag, peer_id=...)`
  and reads the bytes through `Region.view`; `unregister_region()` / `close()` free the memory;
- senders (other processes): connect to the endpoint with `KvSender` and write one-sided.
Who frees what: the receiver owns every region it registered and frees it on unregister/close; a notice
is consumed by the wait/poll that returns it; `discard()` drops notices of a buffer slot being reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from typing import Any

from shared.errors import KvpathError, TransportError
from shared.protocol.transfer import TRANSFER_PROTOCOL, KvEndpoint, RegionInfo, TransferHello, TransferWelcome
from shared.shm import ShmSegment
from shared.transport.config import TransportConfig
from shared.transport.connection import ReceiverConnection
from shared.transport.endpoint import PREFERENCE, host_id
from shared.transport.notices import Notice, NoticeBoard, PeerTable
from shared.transport.region import Region, check_region_name
from shared.transport.segments import control_socket_path, segment_prefix, sweep_stale_segments
from shared.transport.sockio import tune_socket
from shared.transport.timeouts import Deadline, deadline, fail_at
from shared.transport.wire import Limits, check_tag

REJOIN_GRACE_S = 3.0  # a sender gone before a wait for its notice may come back (a restart) this long

log = logging.getLogger(__name__)


class KvReceiver:
    def __init__(self, config: TransportConfig | None = None, *, receiver_id: str = "") -> None:
        self.config = config or TransportConfig()
        self.config.validate()
        self.receiver_id = receiver_id or "rx-" + uuid.uuid4().hex[:12]
        self.limits = Limits(
            self.config.max_meta_bytes, self.config.max_extents_per_write, self.config.max_write_bytes
        )
        self.max_reply_backlog_bytes = self.config.max_reply_backlog_bytes
        self.spin_s = self.config.spin_us * 1e-6
        self._uid = uuid.uuid4().hex[:12]
        self._regions: dict[str, Region] = {}
        self._regions_by_id: dict[int, Region] = {}
        self._next_region_id = 1
        self._board = NoticeBoard(self.config.max_pending_notices)
        self._peers = PeerTable()
        self._connections: set[ReceiverConnection] = set()
        self._listener: socket.socket | None = None
        self._unix_listener: socket.socket | None = None  # shm senders' control connections
        self._accept_tasks: list[asyncio.Task[None]] = []
        self._probe: ShmSegment | None = None
        self._probe_token = ""
        self._rdma: Any = None  # RdmaReceiverSide when an RDMA device is open
        self._address = ""
        self._port = 0
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen for senders; open the shm probe and the RDMA device when those backends are allowed."""
        if self._listener is not None:
            return
        listener = socket.create_server((self.config.bind_host, self.config.port), backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._port = listener.getsockname()[1]
        self._address = self.config.advertise_host or self._default_address()
        if "shm" in self.config.backends:
            self._probe_token = uuid.uuid4().hex
            sweep_stale_segments()
            self._probe = ShmSegment.create(f"{segment_prefix(self._uid)}-probe", 64, replace=True)
            self._probe.buf[: len(self._probe_token)] = self._probe_token.encode()
            self._unix_listener = self._listen_unix()
        if "rdma" in self.config.backends:
            self._rdma = self._open_rdma()
        loop = asyncio.get_running_loop()
        for sock in (listener, self._unix_listener):
            if sock is not None:
                self._accept_tasks.append(loop.create_task(self._accept_loop(sock)))
        log.info(
            "kv receiver %s listening on %s:%s backends=%s",
            self.receiver_id,
            self._address,
            self._port,
            self.offered_backends(),
        )

    def _default_address(self) -> str:
        if self.config.bind_host not in ("", "0.0.0.0", "::"):
            return self.config.bind_host
        return socket.gethostname()

    def _listen_unix(self) -> socket.socket | None:
        """A Unix socket beside the segments (owner-only, swept with them when the owner dies); None when
        it cannot be made (shm senders then connect over tcp)."""
        path = control_socket_path(self._uid)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            path.chmod(0o600)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):
                path.unlink()  # bound but not listening: leave no file behind
            log.warning(
                "kv receiver %s: no Unix control socket (%s); shm senders use tcp", self.receiver_id, exc
            )
            return None
        sock.setblocking(False)
        return sock

    def _open_rdma(self) -> Any:
        import shared.transport.rdma as rdma  # lazy: pyverbs is optional

        ok, reason = rdma.rdma_available(self.config.rdma_device)
        if not ok:
            log.info("kv receiver %s: rdma not offered: %s", self.receiver_id, reason)
            return None
        return rdma.RdmaReceiverSide.open(self.config)

    async def close(self) -> None:
        """Stop serving, fail every waiter, free every region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._accept_tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._listener is not None:
            self._listener.close()
        if self._unix_listener is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_listener.getsockname())
            self._unix_listener.close()
        for conn in list(self._connections):
            conn.close("receiver closing", say_bye=True)
        self._board.fail_all(TransportError(f"receiver {self.receiver_id} closed"))
        for name in list(self._regions):
            self.unregister_region(name)
        if self._rdma is not None:
            self._rdma.close()
        if self._probe is not None:
            self._probe.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as exc:
                log.error("kv receiver %s: accept failed: %s", self.receiver_id, exc)
                await asyncio.sleep(0.1)  # e.g. out of file descriptors: back off, keep serving
                continue
            tune_socket(sock, self.config.socket_buffer_bytes)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else f"unix:{listener.getsockname()}"
            conn = ReceiverConnection(self, sock, peer)
            self._connections.add(conn)
            conn.start()

    # ------------------------------------------------------------------ public API
    def offered_backends(self) -> list[str]:
        offered = {"tcp"} & set(self.config.backends)
        if self._probe is not None:
            offered.add("shm")
        if self._rdma is not None:
            offered.add("rdma")
        return [b for b in PREFERENCE if b in offered]

    def endpoint(self) -> dict[str, Any]:
        """JSON-able descriptor for the registry; senders pass it to `KvSender.connect`."""
        if self._listener is None:
            raise TransportError("KvReceiver.endpoint() before start()")
        return KvEndpoint(
            receiver_id=self.receiver_id,
            host_id=host_id(),
            address=self._address,
            port=self._port,
            backends=self.offered_backends(),
            shm_probe=self._probe.name if self._probe else "",
            shm_token=self._probe_token,
            shm_socket=self._unix_listener.getsockname() if self._unix_listener else "",
            rdma_device=self._rdma.device_name if self._rdma else "",
            regions={name: r.size_bytes for name, r in self._regions.items()},
        ).to_dict()

    def service_endpoints(self) -> dict[str, str]:
        """Where each offered backend is reached, for ServiceInfo.endpoints (the descriptor is endpoint())."""
        out = {"tcp": f"{self._address}:{self._port}"}  # the control connection every backend uses
        if self._probe is not None:
            out["shm"] = host_id()
        if self._rdma is not None:
            out["rdma"] = f"{self._rdma.device_name}:{self.config.rdma_port}"
        return out

    def register_region(self, name: str, size_bytes: int) -> Region:
        """Allocate a zeroed receive region senders can write into (shm-backed when shm is offered)."""
        self._check_open()
        check_region_name(name)
        if name in self._regions:
            raise TransportError(f"region {name!r} is already registered", param="region")
        region_id = self._next_region_id
        self._next_region_id += 1
        shm_name = f"{segment_prefix(self._uid)}-{region_id}" if "shm" in self.config.backends else None
        region = Region(name, region_id, size_bytes, shm_name=shm_name)
        if self._rdma is not None:
            try:
                self._rdma.register_region(region)
            except BaseException:
                region.close()
                raise
        self._regions[name] = region
        self._regions_by_id[region_id] = region
        return region

    def unregister_region(self, name: str) -> None:
        """Free a region: its waiters fail, its held notices go, later writes to it are refused."""
        region = self._regions.pop(name, None)
        if region is None:
            raise TransportError(f"no region named {name!r}", param="region")
        del self._regions_by_id[region.region_id]
        self._board.fail_region(name, TransportError(f"region {name!r} was unregistered"))
        if self._rdma is not None:
            self._rdma.deregister_region(region)
        region.close()

    def region(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise TransportError(f"no region named {name!r}", param="region")
        return region

    async def wait(self, region: str, tag: int, *, timeout_s: float, peer_id: str | None = None) -> Notice:
        """The notice for (region, tag), consumed; waits at most `timeout_s`.

        `peer_id` names the sender expected to post it (its `KvSender.sender_id`): the wait then fails with
        TransportError as soon as that sender has no live connection (at once if it is already gone).
        Without it, only a write cut off mid-transfer or the deadline ends the wait early.
        """
        self._check_open()
        self.region(region)
        check_tag(tag)
        notice = self._board.take(region, tag)
        if notice is not None:
            return notice
        if peer_id is not None:
            reason = self._peers.gone_reason(peer_id)
            if reason is not None:  # gone before the wait: a restarted peer gets a moment to connect again
                started = time.monotonic()
                if not await self._peers.rejoined(peer_id, min(timeout_s, REJOIN_GRACE_S)):
                    raise TransportError(
                        f"peer {peer_id} is gone ({reason}); notice {region!r}/{tag} cannot come"
                    )
                timeout_s = max(0.0, timeout_s - (time.monotonic() - started))
                notice = self._board.take(region, tag)
                if notice is not None:
                    return notice
        loop = asyncio.get_running_loop()
        when = Deadline(timeout_s, f"wait for notice {region!r}/{tag}", loop.time())
        future = self._board.add_waiter(region, tag, peer_id)
        timer = fail_at(loop, future, when)  # a timer on the future: cheaper than a timeout on the task
        try:
            return await future
        except BaseException:  # cancelled after the notice was handed over: keep it for the next wait
            if future.done() and not future.cancelled() and future.exception() is None:
                self._board.restore(future.result())
            raise
        finally:
            timer.cancel()
            self._board.remove_waiter(region, tag, future)

    def poll(self, region: str, tag: int) -> Notice | None:
        """The notice for (region, tag) if it has arrived (consumed), else None. Never blocks."""
        self.region(region)
        return self._board.take(region, check_tag(tag))

    def discard(self, region: str, tags: list[int] | None = None) -> int:
        """Drop held notices of a region (or some tags), e.g. before reusing a buffer slot."""
        return self._board.discard(region, tags)

    def live_peers(self) -> list[str]:
        return self._peers.live()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"receiver {self.receiver_id} is closed")

    # ------------------------------------------------------------------ ReceiverCore (connections)
    def region_by_id(self, region_id: int) -> Region | None:
        return self._regions_by_id.get(region_id)

    def region_by_name(self, name: str) -> Region | None:
        return self._regions.get(name)

    def region_info(self, region: Region) -> RegionInfo:
        addr, rkey = self._rdma.region_keys(region) if self._rdma is not None else (0, 0)
        return RegionInfo(
            name=region.name,
            region_id=region.region_id,
            size_bytes=region.size_bytes,
            shm_segment=region.shm_segment,
            rdma_addr=addr,
            rdma_rkey=rkey,
        )

    def welcome(self, conn: ReceiverConnection, hello: TransferHello) -> TransferWelcome:
        if hello.protocol != TRANSFER_PROTOCOL:
            raise TransportError(
                f"transfer protocol {hello.protocol} not spoken (this is {TRANSFER_PROTOCOL})"
            )
        if hello.backend not in self.offered_backends():
            raise TransportError(f"backend {hello.backend!r} not offered", param="backend")
        if not hello.sender_id:
            raise TransportError("hello without sender_id", param="sender_id")
        rdma_info = None
        if hello.backend == "rdma":
            if hello.rdma is None:
                raise TransportError("rdma hello without queue pair info", param="rdma")
            rdma_info = self._rdma.accept(conn, hello.rdma)
        conn.peer_id, conn.backend = hello.sender_id, hello.backend
        self._peers.connected(hello.sender_id)
        log.info(
            "kv receiver %s: peer %s connected over %s", self.receiver_id, hello.sender_id, hello.backend
        )
        return TransferWelcome(receiver_id=self.receiver_id, backend=hello.backend, rdma=rdma_info)

    def post_notice(self, notice: Notice) -> None:
        self._board.post(notice)

    def fail_notice(self, region: str, tag: int, error: KvpathError) -> None:
        self._board.fail_key(region, tag, error)

    async def join_immediate(self, conn: ReceiverConnection, imm: int) -> None:
        if conn.rdma is None:
            raise TransportError("notice with an RDMA immediate on a connection without RDMA", param="aux")
        timeout_s = self.config.notice_join_timeout_s
        async with deadline(timeout_s, f"RDMA immediate {imm} from {conn.peer_id}"):
            await self._rdma.join_immediate(conn, imm)

    def connection_closed(self, conn: ReceiverConnection, reason: str) -> None:
        self._connections.discard(conn)
        if self._rdma is not None and conn.rdma is not None:
            self._rdma.release(conn)
        if conn.peer_id and self._peers.disconnected(conn.peer_id, reason):
            error = TransportError(f"peer {conn.peer_id} disconnected before its notice: {reason}")
            failed = self._board.fail_peer(conn.peer_id, error)
            if failed:
                log.warning(
                    "kv receiver %s: %d waits failed: peer %s gone", self.receiver_id, failed, conn.peer_id
                )

"""The CXL-RPC server: one thread polls every adopted client's request slots and answers them in place.

A sweep (`poll_once`) reads each request descriptor's sequence number; one that differs from the last seen
is a new request: the handler runs on a view of the request payload, the reply is copied into the slot's
response area, then the response's status and length, then its sequence number (last: on x86-64 the client
that sees it sees the rest). After the sweep one fence, then a futex wake for each answered client that has
a thread asleep (the paper's batched mfence; a spinning client costs no syscall).

Between sweeps the server spins for `server_spin_s`, then sleeps on the doorbell futex (at most
`idle_wake_s`). Every `housekeeping_s` while busy, and on every wake, it refreshes its heartbeat and checks
the client table (`check_clients`): a new client epoch is adopted (its slots join the sweep, the entry's
adopted epoch tells the client it may send); an entry whose lock is free (the process died) or whose epoch
changed or was zeroed (closed, or reclaimed by a new process) is released: `on_client_dead(client_id)` runs
before the entry is served for anybody else.

Nothing a client writes can stop the loop: a garbage descriptor is answered with STATUS_BAD_REQUEST, and the
handler's exceptions, bad statuses and oversized replies become error statuses.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from shared.cxl.futex import check_architecture, fence, futex_wait, futex_wake
from shared.cxl.layout import (
    ADOPTED_EPOCH,
    BODY,
    CLIENT_EPOCH,
    CLIENT_WAITING,
    DOORBELL_OFFSET,
    EPOCH_OFFSET,
    HEADER,
    HEARTBEAT_OFFSET,
    MAX_OP,
    REPLY_WORD,
    SLEEPING_OFFSET,
    client_lock_byte,
)
from shared.cxl.rpc_config import RpcConfig
from shared.cxl.rpc_status import (
    FIRST_HANDLER_STATUS,
    MAX_STATUS,
    STATUS_BAD_REQUEST,
    STATUS_BAD_STATUS,
    STATUS_HANDLER_ERROR,
    STATUS_REPLY_TOO_LARGE,
    Handler,
    OnClientDead,
)
from shared.cxl.segment import RpcSegment

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _ServedSlot:
    """One request/response slot pair of an adopted client, as the sweep sees it: descriptor and payload
    offsets in the file, and the u64 word indexes of the two sequence numbers."""

    client_id: int
    request: int
    response: int
    request_payload: int
    response_payload: int
    request_seq: int
    response_seq: int
    last_seq: int


class RpcServer:
    """Creates the segment `name` and answers its clients with `handler` (see rpc_status.Handler)."""

    def __init__(
        self,
        name: str,
        handler: Handler,
        *,
        config: RpcConfig | None = None,
        on_client_dead: OnClientDead | None = None,
    ) -> None:
        check_architecture()
        self.config = config or RpcConfig()
        self.config.validate()
        self.name = name
        self.layout = self.config.layout
        self._handler = handler
        self._on_client_dead = on_client_dead
        self._segment = RpcSegment.create(name, self.layout.size_bytes)
        self._mm = self._segment.mm
        self._u64, self._u32 = self._segment.u64, self._segment.u32
        self._view = memoryview(self._mm)  # handler payloads are slices of it
        self._payload_bytes = self.layout.payload_bytes
        self._adopted = [0] * self.layout.num_clients  # client epoch served per entry, 0: none
        self._refused = [0] * self.layout.num_clients  # epoch of a client that died before adoption
        self._served: list[_ServedSlot] = []
        self._answered: list[int] = []  # client ids answered in the current sweep
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.epoch = time.time_ns()
        self._mm[0 : HEADER.size] = self.layout.pack_header(0, time.monotonic_ns(), os.getpid())
        self._u64[EPOCH_OFFSET >> 3] = self.epoch  # last: a non-zero epoch means "ready"

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Serve in a dedicated thread until `close()`."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.serve_forever, name=f"cxl-rpc-{self.name}", daemon=True
            )
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the poll thread of `start()` (within `timeout_s`) and remove the segment; clients see the
        server gone. Whoever runs `serve_forever` themselves stops it first (their event, then `wake()`)."""
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("cxl-rpc server %s: poll thread did not stop within %.1fs", self.name, timeout_s)
                return
        self._view.release()
        self._segment.close()

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def adopted_clients(self) -> list[int]:
        return [c for c, epoch in enumerate(self._adopted) if epoch]

    # ------------------------------------------------------------------------------------ poll loop

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Poll, spin, sleep, and keep house until `stop` (default: the one `close()` sets) is set; call
        `wake()` after setting it, or the loop may sleep on for up to `idle_wake_s`."""
        stop = stop or self._stop
        spin_ns = int(self.config.server_spin_s * 1e9)
        housekeeping_ns = int(self.config.housekeeping_s * 1e9)
        next_housekeeping_ns = 0
        last_work_ns = time.monotonic_ns()
        while not stop.is_set():
            served = self.poll_once()
            now_ns = time.monotonic_ns()
            if served:
                last_work_ns = now_ns
            elif now_ns - last_work_ns > spin_ns:
                is_rung = self._sleep(stop)
                now_ns = time.monotonic_ns()
                # rung: a request is likely on its way, spin again; timed out: keep house, sleep again
                last_work_ns = now_ns if is_rung else now_ns - spin_ns - 1
                if self._has_claims():
                    next_housekeeping_ns = 0
            if now_ns >= next_housekeeping_ns:
                self.check_clients()
                next_housekeeping_ns = now_ns + housekeeping_ns

    def poll_once(self) -> int:
        """One sweep over every adopted slot; returns how many requests it answered. A caller driving its
        own loop must also call `check_clients()` every `housekeeping_s` (adoption, heartbeat)."""
        u64 = self._u64
        served = 0
        for slot in self._served:
            seq = u64[slot.request_seq]
            if seq != slot.last_seq:
                slot.last_seq = seq
                self._serve(slot, seq)
                served += 1
        if served:
            self._wake_answered()
        return served

    def _serve(self, slot: _ServedSlot, seq: int) -> None:
        op, length = BODY.unpack_from(self._mm, slot.request + 8)
        reply: bytes | memoryview
        if op > MAX_OP or length > self._payload_bytes:
            detail = f"op {op} (max {MAX_OP}), length {length} (slot holds {self._payload_bytes})"
            status, reply = STATUS_BAD_REQUEST, detail.encode()
        else:
            payload = self._view[slot.request_payload : slot.request_payload + length]
            status, reply = self._call_handler(slot.client_id, op, payload)
        mm = self._mm
        mm[slot.response_payload : slot.response_payload + len(reply)] = reply
        BODY.pack_into(mm, slot.response + 8, status, len(reply))
        self._u64[slot.response_seq] = seq  # last: publishes the reply
        answered = self._answered
        if not answered or answered[-1] != slot.client_id:  # a client's slots are adjacent in the sweep
            answered.append(slot.client_id)

    def _call_handler(self, client_id: int, op: int, payload: memoryview) -> tuple[int, bytes | memoryview]:
        """The handler's (status, reply), or the error status that stands in for it; never raises."""
        try:
            status, reply = self._handler(client_id, op, payload)
            if type(reply) is not bytes:
                view = memoryview(reply)
                reply = view if view.format == "B" and view.ndim == 1 else view.cast("B")
            if not (status == 0 or FIRST_HANDLER_STATUS <= status <= MAX_STATUS):
                return STATUS_BAD_STATUS, f"handler returned status {status} for op {op}".encode()
        except Exception as exc:
            log.warning("cxl-rpc handler failed client=%d op=%d", client_id, op, exc_info=True)
            return STATUS_HANDLER_ERROR, _message(f"{type(exc).__name__}: {exc}", self._payload_bytes)
        if len(reply) > self._payload_bytes:
            detail = f"op {op} replied {len(reply)} bytes, a slot holds {self._payload_bytes}"
            return STATUS_REPLY_TOO_LARGE, _message(detail, self._payload_bytes)
        return int(status), reply

    def _wake_answered(self) -> None:
        """Wake the answered clients that sleep; one fence orders all replies before the flag reads."""
        u32 = self._u32
        fence()
        for client_id in self._answered:
            entry = self.layout.client_entry(client_id)
            if u32[(entry + CLIENT_WAITING) >> 2]:
                word = entry + REPLY_WORD
                u32[word >> 2] = (u32[word >> 2] + 1) & 0xFFFFFFFF
                futex_wake(self._segment.base_address + word)
        self._answered.clear()

    # -------------------------------------------------------------------------------------- sleeping

    def _sleep(self, stop: threading.Event) -> bool:
        """Block on the doorbell until a client rings it, at most idle_wake_s (see futex.py); False when
        the sleep timed out."""
        u32 = self._u32
        expected = u32[DOORBELL_OFFSET >> 2]
        u32[SLEEPING_OFFSET >> 2] = 1
        fence()
        is_rung = True
        if not stop.is_set() and not self._has_requests() and not self._has_claims():
            is_rung = futex_wait(
                self._segment.base_address + DOORBELL_OFFSET, expected, self.config.idle_wake_s
            )
        u32[SLEEPING_OFFSET >> 2] = 0
        return is_rung

    def _has_requests(self) -> bool:
        u64 = self._u64
        return any(u64[slot.request_seq] != slot.last_seq for slot in self._served)

    def _has_claims(self) -> bool:
        for client_id, adopted in enumerate(self._adopted):
            epoch = self._client_epoch(client_id)
            if epoch != adopted and epoch != self._refused[client_id]:
                return True
        return False

    def _client_epoch(self, client_id: int) -> int:
        return int(self._u64[(self.layout.client_entry(client_id) + CLIENT_EPOCH) >> 3])

    def wake(self) -> None:
        """Wake the poll loop if it sleeps (it re-checks its stop event and the slots)."""
        if self._mm.closed:
            return
        index = DOORBELL_OFFSET >> 2
        self._u32[index] = (self._u32[index] + 1) & 0xFFFFFFFF
        futex_wake(self._segment.base_address + DOORBELL_OFFSET)

    # -------------------------------------------------------------------------------- client table

    def check_clients(self) -> None:
        """Heartbeat; adopt new clients, release gone ones (calling on_client_dead)."""
        self._u64[HEARTBEAT_OFFSET >> 3] = time.monotonic_ns()
        for client_id, adopted in enumerate(self._adopted):
            epoch = self._client_epoch(client_id)
            if not adopted and epoch in (0, self._refused[client_id]):
                continue
            is_alive = self._segment.is_locked_by_other(client_lock_byte(client_id))
            if epoch == adopted and is_alive:
                continue
            if adopted:
                self._release(client_id, "process gone" if epoch == adopted else "entry closed or reclaimed")
            if epoch and epoch != adopted and is_alive:
                self._adopt(client_id, epoch)
            elif epoch:  # its process is gone but left its epoch: skip the entry until a new claim
                self._refused[client_id] = epoch

    def _adopt(self, client_id: int, epoch: int) -> None:
        layout = self.layout
        for q in range(layout.queue_depth):
            request = layout.request_descriptor(client_id, q)
            response = layout.response_descriptor(client_id, q)
            slot = _ServedSlot(
                client_id,
                request,
                response,
                layout.request_payload(client_id, q),
                layout.response_payload(client_id, q),
                request_seq=request >> 3,
                response_seq=response >> 3,
                last_seq=int(self._u64[request >> 3]),  # what a predecessor left is never served
            )
            self._served.append(slot)
        self._served.sort(key=lambda s: s.client_id)
        self._adopted[client_id] = epoch
        self._u64[(layout.client_entry(client_id) + ADOPTED_EPOCH) >> 3] = epoch  # "you may send"
        log.debug("cxl-rpc %s: adopted client=%d", self.name, client_id)

    def _release(self, client_id: int, reason: str) -> None:
        self._served = [s for s in self._served if s.client_id != client_id]
        self._adopted[client_id] = 0
        self._u64[(self.layout.client_entry(client_id) + ADOPTED_EPOCH) >> 3] = 0
        log.info("cxl-rpc %s: client=%d released (%s)", self.name, client_id, reason)
        if self._on_client_dead is not None:
            try:
                self._on_client_dead(client_id)
            except Exception:
                log.exception("cxl-rpc %s: on_client_dead failed client=%d", self.name, client_id)


def _message(text: str, limit_bytes: int) -> bytes:
    return text.encode("utf-8", "replace")[:limit_bytes]

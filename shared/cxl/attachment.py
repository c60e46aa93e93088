"""One client's hold on one server's segment: its claimed entry, its slots, publishing and waiting.

Claiming an entry (no atomics in Python): the client takes the OFD lock on byte 1 + c of the segment file
for the first free c (the kernel arbitrates between processes, and drops the lock when the process dies,
which is also how the server learns a client died), reads the sequence numbers its predecessor left in the
entry's slots and goes on from them, writes pid and heartbeat, then a fresh client epoch (last), rings the
doorbell and waits until the server writes that epoch into the entry's adopted field. Only then does it
send: the server has by then released the predecessor (on_client_dead) and skipped anything it left.

Waiting for a reply: spin on the response's sequence number, then sleep on the entry's reply futex (the
protocol in futex.py; `waiting` counts the client's sleeping threads). Every `liveness_check_s` a waiting
thread checks the server: its lock (dead process: immediate), the name (a restart put a new file there), its
heartbeat (hung). Any of these marks the attachment failed; its calls raise ServiceUnavailableError and the
owning RpcClient attaches anew on its next call.

A slot is reused only once its request was answered: a call that times out leaves its slot with the server
(`_unanswered`) and takes it back when the late reply lands, so the server never reads a payload that its
client is overwriting.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass

from shared.cxl.futex import fence, futex_wait, futex_wake
from shared.cxl.layout import (
    ADOPTED_EPOCH,
    BODY,
    CLIENT_EPOCH,
    CLIENT_HEARTBEAT,
    CLIENT_PID,
    CLIENT_WAITING,
    DOORBELL_OFFSET,
    EPOCH_OFFSET,
    HEADER,
    HEARTBEAT_OFFSET,
    REPLY_WORD,
    SERVER_LOCK_BYTE,
    SLEEPING_OFFSET,
    Layout,
    client_lock_byte,
)
from shared.cxl.rpc_config import RpcConfig
from shared.cxl.rpc_status import deadline_error, error_for_status, is_transport_status, unavailable
from shared.cxl.segment import RpcSegment
from shared.errors import ProtocolError, ServiceUnavailableError

_POLL_S = 0.0005  # readiness and adoption are polled: they happen once per attach


@dataclass(slots=True)
class ClientSlot:
    """One request/response slot pair of the claimed entry: offsets in the file, the u64 word indexes of
    the two sequence numbers, and the last sequence number it sent."""

    index: int
    request: int
    response: int
    request_payload: int
    response_payload: int
    request_seq: int
    response_seq: int
    seq: int


class ClientAttachment:
    """A claimed entry of one server's segment. Built by `RpcClient`, which owns and replaces it."""

    def __init__(self, name: str, config: RpcConfig, deadline_ns: int) -> None:
        self.config = config
        self.segment, self.layout, self.server_epoch = _open_ready(name, config, deadline_ns)
        self.mm = self.segment.mm
        self.u64, self.u32 = self.segment.u64, self.segment.u32
        self.failure: str | None = None  # why calls can no longer go through this attachment
        self.is_closed = False
        self.payload_bytes = self.layout.payload_bytes
        self._unmap = weakref.finalize(self, self.segment.close)
        self._waiting_lock = threading.Lock()
        self._num_waiting = 0
        self._unanswered: list[tuple[ClientSlot, int]] = []
        try:
            self.client_id = self._lock_free_entry()
            self.entry = self.layout.client_entry(self.client_id)
            self.slots = [self._slot(q) for q in range(self.layout.queue_depth)]
            self._free = list(reversed(self.slots))
            self.epoch = self._claim(deadline_ns)
        except BaseException:
            self._unmap()
            raise

    # ---------------------------------------------------------------------------------------- claim

    def _lock_free_entry(self) -> int:
        for client_id in range(self.layout.num_clients):
            if self.segment.try_lock(client_lock_byte(client_id)):
                return client_id
        raise unavailable(
            f"all {self.layout.num_clients} client entries of {self.segment.path.name} are taken"
        )

    def _slot(self, q: int) -> ClientSlot:
        layout, c = self.layout, self.client_id
        request = layout.request_descriptor(c, q)
        response = layout.response_descriptor(c, q)
        return ClientSlot(
            q,
            request,
            response,
            layout.request_payload(c, q),
            layout.response_payload(c, q),
            request_seq=request >> 3,
            response_seq=response >> 3,
            seq=int(self.u64[request >> 3]),  # go on from the predecessor's numbers
        )

    def _claim(self, deadline_ns: int) -> int:
        u64, u32, entry = self.u64, self.u32, self.entry
        epoch = max(time.time_ns(), u64[(entry + CLIENT_EPOCH) >> 3] + 1)
        u64[(entry + CLIENT_HEARTBEAT) >> 3] = time.monotonic_ns()
        u32[(entry + CLIENT_PID) >> 2] = os.getpid()
        u32[(entry + CLIENT_WAITING) >> 2] = 0
        u64[(entry + CLIENT_EPOCH) >> 3] = epoch  # last: the claim is complete
        fence()
        self._ring_if_asleep()
        while u64[(entry + ADOPTED_EPOCH) >> 3] != epoch:
            self.check_server()
            if time.monotonic_ns() >= deadline_ns:
                raise unavailable(f"server did not adopt client {self.client_id} in time")
            time.sleep(_POLL_S)
        return epoch

    # ---------------------------------------------------------------------------------------- slots

    def try_acquire_slot(self) -> ClientSlot | None:
        try:
            return self._free.pop()  # list.pop/append are atomic under the GIL
        except IndexError:
            pass
        if self._unanswered:
            self._take_back_answered()
            try:
                return self._free.pop()
            except IndexError:
                pass
        return None

    def acquire_slot(self, deadline_ns: int, timeout_s: float) -> ClientSlot:
        """A free slot, waiting (bounded by the deadline) while all are in flight."""
        delay_s = 50e-6
        while (slot := self.try_acquire_slot()) is None:
            if self.failure is not None:
                raise unavailable(self.failure)
            if time.monotonic_ns() >= deadline_ns:
                raise deadline_error(f"call found all {len(self.slots)} slots in flight", timeout_s)
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, 1e-3)
        return slot

    def release_slot(self, slot: ClientSlot) -> None:
        self._free.append(slot)

    def _leave_with_server(self, slot: ClientSlot, seq: int) -> None:
        with self._waiting_lock:
            self._unanswered.append((slot, seq))

    def _take_back_answered(self) -> None:
        with self._waiting_lock:
            pending, self._unanswered = self._unanswered, []
            for slot, seq in pending:
                if self.u64[slot.response_seq] == seq:
                    self._free.append(slot)
                else:
                    self._unanswered.append((slot, seq))

    # ------------------------------------------------------------------------------- publish, reply

    def publish(self, slot: ClientSlot, op: int, payload: bytes | bytearray | memoryview, length: int) -> int:
        """Write the request (payload, op and length, then the sequence number); returns the sequence."""
        mm = self.mm
        if length:
            mm[slot.request_payload : slot.request_payload + length] = payload
        BODY.pack_into(mm, slot.request + 8, op, length)
        seq = slot.seq + 1
        slot.seq = seq
        self.u64[slot.request_seq] = seq  # last: publishes the request
        fence()  # the seq store before the sleeping-flag load (futex.py)
        if self.u32[SLEEPING_OFFSET >> 2]:
            self._ring_if_asleep()
        return seq

    def take_reply(self, slot: ClientSlot) -> tuple[int, bytes]:
        """The answered slot's (status, reply); frees the slot. Transport statuses raise."""
        mm = self.mm
        status, length = BODY.unpack_from(mm, slot.response + 8)
        if length > self.payload_bytes:
            self._free.append(slot)
            raise ProtocolError(f"CXL-RPC reply of {length} bytes in a {self.payload_bytes}-byte slot")
        reply = mm[slot.response_payload : slot.response_payload + length]
        self._free.append(slot)
        if is_transport_status(status):
            raise error_for_status(status, reply)
        return status, reply

    def finish(self, slot: ClientSlot, seq: int, deadline_ns: int, timeout_s: float) -> tuple[int, bytes]:
        """Sleep until the reply to `seq` lands (see the module docstring), then take it."""
        u64, u32, word = self.u64, self.u32, self.entry + REPLY_WORD
        next_check_ns = 0
        while u64[slot.response_seq] != seq:
            now_ns = time.monotonic_ns()
            if self.failure is not None or now_ns >= next_check_ns:
                self._check_while_waiting(slot, seq)
                next_check_ns = now_ns + int(self.config.liveness_check_s * 1e9)
            if now_ns >= deadline_ns:
                self._leave_with_server(slot, seq)
                raise deadline_error(f"op got no reply (client {self.client_id})", timeout_s)
            expected = u32[word >> 2]
            self._add_waiting(1)
            try:
                if u64[slot.response_seq] == seq:
                    break
                sleep_s = (min(deadline_ns, next_check_ns) - now_ns) / 1e9
                futex_wait(self.segment.base_address + word, expected, sleep_s)
            finally:
                self._add_waiting(-1)
        return self.take_reply(slot)

    def _add_waiting(self, delta: int) -> None:
        with self._waiting_lock:
            self._num_waiting += delta
            self.u32[(self.entry + CLIENT_WAITING) >> 2] = self._num_waiting
        fence()  # the flag store before the re-check load (futex.py)

    def _check_while_waiting(self, slot: ClientSlot, seq: int) -> None:
        try:
            self.check_server()
        except ServiceUnavailableError:
            self._leave_with_server(slot, seq)  # never answered now; the attachment is done for
            raise
        self.u64[(self.entry + CLIENT_HEARTBEAT) >> 3] = time.monotonic_ns()  # informational

    def _ring_if_asleep(self) -> None:
        u32 = self.u32
        if u32[SLEEPING_OFFSET >> 2]:
            u32[DOORBELL_OFFSET >> 2] = (u32[DOORBELL_OFFSET >> 2] + 1) & 0xFFFFFFFF
            futex_wake(self.segment.base_address + DOORBELL_OFFSET, 1)

    # ----------------------------------------------------------------------------------- liveness

    def check_server(self) -> None:
        """Raise ServiceUnavailableError (and mark the attachment failed) unless the server is serving."""
        if self.failure is None:
            self.failure = _server_problem(self.segment, self.config)
        if self.failure is not None:
            raise unavailable(self.failure)

    def close(self, reason: str = "client closed") -> None:
        """Give the entry back (the server releases it) and fail calls still waiting; idempotent.

        The mapping stays until `unmap()` or garbage collection: a thread still inside a call may read it.
        """
        if self.is_closed or self.mm.closed:
            return
        self.is_closed = True
        self.failure = self.failure or reason
        self.u64[(self.entry + CLIENT_EPOCH) >> 3] = 0
        self.segment.unlock(client_lock_byte(self.client_id))
        futex_wake(self.segment.base_address + self.entry + REPLY_WORD)  # sleepers see `failure`
        self._ring_if_asleep()

    def unmap(self) -> None:
        self._unmap()


def _open_ready(name: str, config: RpcConfig, deadline_ns: int) -> tuple[RpcSegment, Layout, int]:
    """Map the segment once its server has written the header and holds its lock (a starting server
    is waited for, within the deadline; a dead one is refused at once)."""
    while True:
        try:
            segment = RpcSegment.attach(name)  # no file: no server, ServiceUnavailableError at once
        except ValueError:  # the file exists but is still empty: its server is creating it
            segment = None
        if segment is not None:
            try:
                ready = _ready_header(segment)
                if ready is not None:
                    problem = _server_problem(segment, config)
                    if problem is not None:
                        raise unavailable(problem)
                    return segment, ready[0], ready[1]
            except BaseException:
                segment.close()
                raise
            segment.close()
        if time.monotonic_ns() >= deadline_ns:
            raise unavailable(f"segment {name} did not become ready in time")
        time.sleep(_POLL_S)


def _ready_header(segment: RpcSegment) -> tuple[Layout, int] | None:
    if segment.size_bytes < HEADER.size or segment.u64[EPOCH_OFFSET >> 3] == 0:
        return None
    try:
        layout = Layout.from_header(segment.mm, segment.size_bytes)
    except ValueError as exc:
        raise unavailable(f"{segment.path.name} is not a usable segment: {exc}") from None
    return layout, int(segment.u64[EPOCH_OFFSET >> 3])


def _server_problem(segment: RpcSegment, config: RpcConfig) -> str | None:
    """Why the segment's server cannot answer, or None."""
    if not segment.is_locked_by_other(SERVER_LOCK_BYTE):
        if segment.is_current():
            return "server process gone"
        return "server restarted or gone (its segment was replaced or removed)"
    age_s = (time.monotonic_ns() - segment.u64[HEARTBEAT_OFFSET >> 3]) / 1e9
    if age_s > config.server_stale_s:
        return f"server heartbeat is {age_s:.2f}s old (hung?)"
    return None

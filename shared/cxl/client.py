"""The CXL-RPC client: `call` (synchronous, spin then futex) and `acall` (asyncio) over one claimed entry.

Up to `queue_depth` calls are in flight at once, each in its own slot (threads calling `call`, or asyncio
tasks calling `acall`); a call that finds every slot busy waits for one within its deadline.

`acall` never blocks the event loop for long: it publishes and spins for `async_spin_s` on the loop, then
waits in one of the client's worker threads (one per slot, so waits never queue behind each other). A
cancelled `acall` leaves its worker to collect the reply and free the slot.

Server failures make waiting calls raise ServiceUnavailableError, not wait for their deadline: a dead server
(its lock gone) or a restarted one (a new file under the name) within `liveness_check_s`, a hung one once
its heartbeat is older than `server_stale_s`. Restart policy: a call never runs on a server other than the one
the client attached to, so every restart shows up as at least one ServiceUnavailableError (whatever the
caller held on the old server is gone with it); the next call then attaches to the new server (a new entry
and a new `server_epoch`, within that call's deadline), or fails fast while none serves the name.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from shared.cxl.attachment import ClientAttachment, ClientSlot
from shared.cxl.futex import check_architecture
from shared.cxl.layout import MAX_OP
from shared.cxl.rpc_config import RpcConfig
from shared.cxl.rpc_status import check_op, deadline_error, unavailable
from shared.errors import InvalidRequestError

Payload = bytes | bytearray | memoryview


class RpcClient:
    """A client of the CXL-RPC server behind segment `name` (on this host). Attaching blocks for at most
    `config.attach_timeout_s` and raises ServiceUnavailableError when no server serves the name."""

    def __init__(self, name: str, *, config: RpcConfig | None = None) -> None:
        check_architecture()
        self.name = name
        self.config = config or RpcConfig()
        self.config.validate()
        self._spin_ns = int(self.config.client_spin_s * 1e9)
        self._async_spin_ns = int(self.config.async_spin_s * 1e9)
        self._attach_lock = threading.Lock()
        self._is_closed = False
        self._executor: ThreadPoolExecutor | None = None
        self._att = ClientAttachment(name, self.config, self._attach_deadline_ns(None))

    @property
    def client_id(self) -> int:
        return self._att.client_id

    @property
    def server_epoch(self) -> int:
        """The epoch of the server this client talks to; it changes when a call re-attaches."""
        return self._att.server_epoch

    @property
    def payload_bytes(self) -> int:
        """The largest payload (and reply) a call can carry."""
        return self._att.payload_bytes

    @property
    def queue_depth(self) -> int:
        return len(self._att.slots)

    # --------------------------------------------------------------------------------------- calls

    def call(self, op: int, payload: Payload = b"", timeout_s: float = 1.0) -> tuple[int, bytes]:
        """Send one request and wait for its (status, reply); the handler's statuses only (see rpc_status).

        Raises DeadlineExceededError past `timeout_s`, ServiceUnavailableError when the server is gone,
        InvalidRequestError for a bad op or a payload beyond `payload_bytes`.
        """
        start_ns = time.monotonic_ns()
        deadline_ns = start_ns + int(timeout_s * 1e9)
        att = self._att if self._att.failure is None else self._reattach(deadline_ns)
        length = _length(att, op, payload)
        slot = att.try_acquire_slot() or att.acquire_slot(deadline_ns, timeout_s)
        try:
            seq = att.publish(slot, op, payload, length)
        except BaseException:
            att.release_slot(slot)
            raise
        u64, response_seq = att.u64, slot.response_seq
        spin_end_ns = start_ns + self._spin_ns
        while u64[response_seq] != seq:
            if time.monotonic_ns() > spin_end_ns:
                return att.finish(slot, seq, deadline_ns, timeout_s)
        return att.take_reply(slot)

    async def acall(self, op: int, payload: Payload = b"", timeout_s: float = 1.0) -> tuple[int, bytes]:
        """`call` for asyncio callers: at most ~`async_spin_s` (plus the copy) on the event loop."""
        start_ns = time.monotonic_ns()
        deadline_ns = start_ns + int(timeout_s * 1e9)
        loop = asyncio.get_running_loop()
        att = self._att
        if att.failure is not None:
            att = await loop.run_in_executor(self._workers(), self._reattach, deadline_ns)
        length = _length(att, op, payload)
        slot = att.try_acquire_slot() or await self._aacquire(att, deadline_ns, timeout_s)
        try:
            seq = att.publish(slot, op, payload, length)
        except BaseException:
            att.release_slot(slot)
            raise
        u64, response_seq = att.u64, slot.response_seq
        spin_end_ns = time.monotonic_ns() + self._async_spin_ns
        while u64[response_seq] != seq:
            if time.monotonic_ns() > spin_end_ns:
                return await loop.run_in_executor(
                    self._workers(), att.finish, slot, seq, deadline_ns, timeout_s
                )
        return att.take_reply(slot)

    async def _aacquire(self, att: ClientAttachment, deadline_ns: int, timeout_s: float) -> ClientSlot:
        delay_s = 50e-6
        while (slot := att.try_acquire_slot()) is None:
            if att.failure is not None:
                raise unavailable(att.failure)
            if time.monotonic_ns() >= deadline_ns:
                raise deadline_error(f"acall found all {len(att.slots)} slots in flight", timeout_s)
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, 1e-3)
        return slot

    # ---------------------------------------------------------------------------------- attachment

    def _reattach(self, deadline_ns: int) -> ClientAttachment:
        """Replace a failed attachment (the server died or restarted) with a fresh one, once per failure."""
        with self._attach_lock:
            att = self._att
            if att.failure is None:
                return att  # another thread re-attached first
            if self._is_closed:
                raise unavailable("client closed")
            att.close(att.failure)
            self._att = ClientAttachment(self.name, self.config, self._attach_deadline_ns(deadline_ns))
            return self._att

    def _attach_deadline_ns(self, call_deadline_ns: int | None) -> int:
        own_ns = time.monotonic_ns() + int(self.config.attach_timeout_s * 1e9)
        return own_ns if call_deadline_ns is None else min(own_ns, call_deadline_ns)

    def _workers(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.queue_depth, thread_name_prefix=f"cxl-rpc-{self.client_id}"
            )
        return self._executor

    def close(self) -> None:
        """Give the entry back (the server calls on_client_dead for it); calls still waiting raise
        ServiceUnavailableError within `liveness_check_s`. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        att = self._att
        att.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        att.unmap()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _length(att: ClientAttachment, op: int, payload: Payload) -> int:
    """The payload's size in bytes, refusing what no server would accept."""
    length = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
    if length > att.payload_bytes or not 0 <= op <= MAX_OP:
        check_op(op)
        raise InvalidRequestError(
            f"CXL-RPC payload of {length} bytes exceeds the slot's {att.payload_bytes}", param="payload"
        )
    return length

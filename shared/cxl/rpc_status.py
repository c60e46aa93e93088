"""The call shape every CXL-RPC transport shares, and the transport's own status codes.

A call carries (op: int, payload: bytes) to a handler and brings back (status: int, reply: bytes). The
transport knows nothing of what ops mean: ops 0..MAX_OP belong to the service built on it (the Beluga pool
service), and so do status 0 (OK) and statuses from FIRST_HANDLER_STATUS up. Statuses 1..99 are the
transport's own; clients raise them as `shared.errors` exceptions (`error_for_status`), so `call` returns only
statuses the handler chose:

    STATUS_HANDLER_ERROR    the handler raised          -> ServiceUnavailableError (it could not serve)
    STATUS_REPLY_TOO_LARGE  reply beyond the reply slot -> ServiceUnavailableError
    STATUS_BAD_STATUS       handler status in 1..99     -> ServiceUnavailableError
    STATUS_BAD_REQUEST      garbage descriptor          -> ProtocolError (a broken client)
"""

from __future__ import annotations

from collections.abc import Callable

from shared.cxl.layout import MAX_OP
from shared.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KvpathError,
    ProtocolError,
    ServiceUnavailableError,
)

Reply = bytes | bytearray | memoryview
# handler(client_id, op, payload) -> (status, reply). Called by the server's poll thread, one request at a
# time; `payload` is a view of the request slot, valid only during the call (copy what you keep). It may
# raise anything: the caller gets STATUS_HANDLER_ERROR and the server keeps serving.
Handler = Callable[[int, int, memoryview], tuple[int, Reply]]
# on_client_dead(client_id): the client on that entry is gone (its process died, or it closed); called by
# the poll thread between requests, before the entry is served for another client.
OnClientDead = Callable[[int], None]

STATUS_OK = 0
STATUS_HANDLER_ERROR = 1  # the handler raised; the reply is its message (utf-8)
STATUS_REPLY_TOO_LARGE = 2  # the handler's reply does not fit a reply slot
STATUS_BAD_REQUEST = 3  # a garbage descriptor: op above MAX_OP or length beyond the slot
STATUS_BAD_STATUS = 4  # the handler returned a status reserved for the transport (1..99)
FIRST_HANDLER_STATUS = 100
MAX_STATUS = 0xFFFF_FFFF


def is_transport_status(status: int) -> bool:
    return 0 < status < FIRST_HANDLER_STATUS


def error_for_status(status: int, reply: bytes) -> KvpathError:
    """The exception a client raises for one of the transport's statuses."""
    detail = reply.decode("utf-8", "replace")
    if status == STATUS_BAD_REQUEST:
        return ProtocolError(f"CXL-RPC request refused: {detail}")
    what = {
        STATUS_HANDLER_ERROR: "handler failed",
        STATUS_REPLY_TOO_LARGE: "reply too large",
        STATUS_BAD_STATUS: "handler returned a reserved status",
    }.get(status, f"transport status {status}")
    return ServiceUnavailableError(f"CXL-RPC {what}: {detail}")


def check_op(op: int) -> None:
    if not 0 <= op <= MAX_OP:
        raise InvalidRequestError(f"CXL-RPC op must be in 0..{MAX_OP}, got {op}", param="op")


def deadline_error(what: str, timeout_s: float) -> DeadlineExceededError:
    return DeadlineExceededError(f"CXL-RPC {what} within {timeout_s:.3f}s")


def unavailable(reason: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(f"CXL-RPC server unavailable: {reason}")

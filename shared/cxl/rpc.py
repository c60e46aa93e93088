"""CXL-RPC: request/response rings in a shared-memory segment between one server and its clients.

The transport of the Beluga pool service (paper section 6.2): clients on the pool's host write a request into
a slot of their own and flip its sequence number; the server's poll thread answers into the paired response
slot; no network stack, no syscall on a busy path (futexes only when a side has gone to sleep). It carries
(op, payload bytes) -> (status, reply bytes) and knows nothing of what the ops mean.

    server = RpcServer("pool-0-rpc", handler, on_client_dead=release_pins)   # creates the segment
    server.start()                                                          # the poll thread
    client = RpcClient("pool-0-rpc")                                        # another process, same host
    status, reply = client.call(op, payload, timeout_s)                     # or: await client.acall(...)

Modules: `layout` (the bytes), `segment` (the file, liveness locks), `futex` (sleep and wake, the fence),
`server`, `attachment` and `client` (the two sides), `rpc_status` (statuses, handler type), `rpc_config`,
`nats_rpc` (the same calls over NATS, for other hosts); `loadgen/bench/beluga_rpc.py` measures round trips.
"""

from __future__ import annotations

from shared.cxl.client import RpcClient
from shared.cxl.layout import MAX_OP, Layout
from shared.cxl.rpc_config import RpcConfig
from shared.cxl.rpc_status import (
    FIRST_HANDLER_STATUS,
    STATUS_BAD_REQUEST,
    STATUS_BAD_STATUS,
    STATUS_HANDLER_ERROR,
    STATUS_OK,
    STATUS_REPLY_TOO_LARGE,
    Handler,
    OnClientDead,
    error_for_status,
)
from shared.cxl.server import RpcServer

__all__ = [
    "FIRST_HANDLER_STATUS",
    "MAX_OP",
    "STATUS_BAD_REQUEST",
    "STATUS_BAD_STATUS",
    "STATUS_HANDLER_ERROR",
    "STATUS_OK",
    "STATUS_REPLY_TOO_LARGE",
    "Handler",
    "Layout",
    "OnClientDead",
    "RpcClient",
    "RpcConfig",
    "RpcServer",
    "error_for_status",
]

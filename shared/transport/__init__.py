"""KV data plane: one-sided writes into a registered remote region, then a completion notice.

RDMA WRITE-with-immediate semantics over three backends that share one protocol (see `wire.py`):
`shm` (same host: memcpy into the receiver's shared-memory region), `tcp` (framed payload received
straight into the region) and `rdma` (pyverbs RC queue pair, WRITE WITH IMMEDIATE). The backend is
chosen per peer pair (`endpoint.select_backend`). Receivers: `KvReceiver`; senders: `KvSender` -> `Peer`.
"""

from shared.transport.config import TransportConfig
from shared.transport.endpoint import LocalCaps, host_id, parse_endpoint, select_backend
from shared.transport.notices import Notice
from shared.transport.receiver import KvReceiver
from shared.transport.region import Region
from shared.transport.sender import KvSender, Peer

__all__ = [
    "KvReceiver",
    "KvSender",
    "LocalCaps",
    "Notice",
    "Peer",
    "Region",
    "TransportConfig",
    "host_id",
    "parse_endpoint",
    "select_backend",
]

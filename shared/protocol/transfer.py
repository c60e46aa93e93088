"""Records of the KV data plane (`shared.transport`): the endpoint a receiver announces in the registry and
the small JSON messages its control connection carries (hello, welcome, region lookup).

KV bytes never travel in these records; they name regions by id and size. Validation is the codec's:
`from_dict(obj, KvEndpoint)` on a registry entry, `decode(meta, RegionInfo)` on a control frame.
"""

from __future__ import annotations

from dataclasses import field

from shared.protocol.codec import Message, message

TRANSFER_PROTOCOL = 1


@message
class RdmaQpInfo(Message):
    """One side of an RC queue pair, exchanged in hello/welcome to connect the pair."""

    KIND = "rdma_qp_info"
    qp_num: int
    psn: int
    lid: int
    gid: str  # "xxxx:xxxx:...:xxxx"; all zeros on InfiniBand without GRH
    mtu: int  # ibv_mtu enum value of the active port


@message
class KvEndpoint(Message):
    """What a KV receiver announces (ServiceInfo.extra["kv_endpoint"]); senders connect with it."""

    KIND = "kv_endpoint"
    receiver_id: str
    host_id: str  # hostname, boot id and /dev/shm device: equal only on one host and one shm mount
    address: str
    port: int
    backends: list[str]  # offered, best first; rdma only when a device is open
    protocol: int = TRANSFER_PROTOCOL
    shm_probe: str = ""  # shm segment holding shm_token: senders verify they really share /dev/shm
    shm_token: str = ""
    shm_socket: str = ""  # Unix socket of the control connection for shm senders (in the same /dev/shm)
    rdma_device: str = ""
    regions: dict[str, int] = field(default_factory=dict)  # name -> size in bytes, for inspection


@message
class TransferHello(Message):
    """First frame of a control connection: who is sending and over which backend."""

    KIND = "transfer_hello"
    sender_id: str
    backend: str
    protocol: int = TRANSFER_PROTOCOL
    host_id: str = ""
    rdma: RdmaQpInfo | None = None


@message
class TransferWelcome(Message):
    KIND = "transfer_welcome"
    receiver_id: str
    backend: str
    rdma: RdmaQpInfo | None = None


@message
class RegionInfo(Message):
    """A registered region as a sender needs it: id for frames, size for bounds, how to reach its bytes."""

    KIND = "kv_region"
    name: str
    region_id: int
    size_bytes: int
    shm_segment: str = ""
    rdma_addr: int = 0
    rdma_rkey: int = 0

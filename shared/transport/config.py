"""Knobs of the KV data plane, shared by its receiver and sender sides.

Services embed one `TransportConfig` (built from their own config's fields or defaults) and pass it to
`KvReceiver` / `KvSender`; the transport never reads globals or the environment itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import check, doc

BACKENDS = ("shm", "rdma", "tcp")


@dataclass(slots=True)
class TransportConfig:
    bind_host: str = doc("127.0.0.1", "address the KV receiver listens on (0.0.0.0: every interface)")
    advertise_host: str = doc("", "address announced to senders; empty: bind_host, or this host's name")
    port: int = doc(0, "TCP port of the KV receiver's control connection; 0 picks a free one")
    # doc() of a list returns a field with a default_factory, so no list object is shared
    backends: list[str] = doc(list(BACKENDS), "backends this process may offer and use")  # noqa: RUF009
    rdma_device: str = doc("", "RDMA device name; empty: the first device listed")
    rdma_port: int = doc(1, "port number on the RDMA device")
    rdma_gid_index: int = doc(-1, "GID table index; -1 picks the first non-zero GID (RoCE) or 0 (IB)")
    rdma_queue_depth: int = doc(512, "send/receive work requests per RDMA queue pair")
    socket_buffer_bytes: int = doc(4 << 20, "SO_SNDBUF/SO_RCVBUF of control connections")
    max_meta_bytes: int = doc(64 << 10, "largest notice metadata (and control message) in bytes")
    max_extents_per_write: int = doc(1 << 16, "most extents in one write_many call")
    max_write_bytes: int = doc(1 << 36, "largest total payload of one write in bytes")
    max_pending_notices: int = doc(1 << 16, "notices held for nobody-waiting-yet before senders get errors")
    max_reply_backlog_bytes: int = doc(1 << 20, "unsent replies to a sender that stopped reading: then close")
    notice_join_timeout_s: float = doc(5.0, "RDMA: how long a notice waits for its write-with-immediate")
    spin_us: float = doc(
        60.0,
        "busy-poll a control socket up to this long for an op's reply (sender) or the next frame "
        "(receiver), backing off while it does not pay (spin.py); 0: off",
    )

    def validate(self) -> None:
        unknown = sorted(set(self.backends) - set(BACKENDS))
        check(not unknown, "backends", self.backends, f"unknown backends {unknown}; known: {BACKENDS}")
        check(bool(self.backends), "backends", self.backends, "must name at least one backend")
        check(0 <= self.port < 65536, "port", self.port, "must be a port number")
        check(self.rdma_port >= 1, "rdma_port", self.rdma_port, "must be >= 1")
        check(self.rdma_queue_depth >= 16, "rdma_queue_depth", self.rdma_queue_depth, "must be >= 16")
        for name in (
            "socket_buffer_bytes",
            "max_meta_bytes",
            "max_extents_per_write",
            "max_write_bytes",
            "max_pending_notices",
            "max_reply_backlog_bytes",
        ):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        check(
            self.notice_join_timeout_s > 0, "notice_join_timeout_s", self.notice_join_timeout_s, "must be > 0"
        )
        check(0 <= self.spin_us <= 10_000, "spin_us", self.spin_us, "must be in [0, 10000]")

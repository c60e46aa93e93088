"""Host identity, endpoint descriptors and the per-peer-pair backend choice (pure, but for the probe).

Choice, best first: `shm` when both ends share a host and a /dev/shm mount (equal `host_id`) and both
offer it; `rdma` when both ends have an open RDMA device; else `tcp`. The shm guess from `host_id` is
confirmed by `probe_shm` (the sender maps the receiver's probe segment and reads its token) because two
containers on one host can share a boot id but not /dev/shm.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from dataclasses import dataclass
from typing import Any

from shared.errors import ProtocolError, TransportError
from shared.protocol.codec import from_dict
from shared.protocol.transfer import TRANSFER_PROTOCOL, KvEndpoint
from shared.shm import ShmSegment, segment_path

PREFERENCE = ("shm", "rdma", "tcp")


@functools.cache
def host_id() -> str:
    """Equal for two processes exactly when they can map the same /dev/shm files (cached per process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    shm_dir = segment_path("probe").parent
    return f"{socket.gethostname()}/{boot_id}/{os.stat(shm_dir).st_dev}"


@dataclass(slots=True, frozen=True)
class LocalCaps:
    """What this process can use: its host and the backends allowed and working here."""

    host_id: str
    backends: tuple[str, ...]  # allowed by config and available (rdma only with an open device)


def parse_endpoint(endpoint: dict[str, Any] | KvEndpoint) -> KvEndpoint:
    """Validate a registry descriptor; raise TransportError when it is not a KV endpoint we speak."""
    if isinstance(endpoint, KvEndpoint):
        parsed = endpoint
    else:
        try:
            parsed = from_dict(endpoint, KvEndpoint)
        except ProtocolError as exc:
            raise TransportError(f"bad KV endpoint descriptor: {exc.message}", param="endpoint") from None
    if parsed.protocol != TRANSFER_PROTOCOL:
        raise TransportError(
            f"receiver {parsed.receiver_id} speaks transfer protocol {parsed.protocol}, "
            f"this build speaks {TRANSFER_PROTOCOL}",
            param="endpoint",
        )
    return parsed


def candidate_backends(local: LocalCaps, remote: KvEndpoint) -> list[str]:
    """Usable backends for this pair, best first (shm only on a shared host)."""
    out = []
    for name in PREFERENCE:
        if name not in local.backends or name not in remote.backends:
            continue
        if name == "shm" and local.host_id != remote.host_id:
            continue
        out.append(name)
    return out


def select_backend(local: LocalCaps, remote: KvEndpoint, *, forced: str | None = None) -> str:
    """The backend for this pair; `forced` must be usable or TransportError says why not."""
    usable = candidate_backends(local, remote)
    if forced is not None:
        if forced not in usable:
            raise TransportError(
                f"backend {forced!r} is not usable with receiver {remote.receiver_id}: "
                f"local {list(local.backends)}, remote {remote.backends}, usable {usable}",
                param="backend",
            )
        return forced
    if not usable:
        raise TransportError(
            f"no common backend with receiver {remote.receiver_id}: "
            f"local {list(local.backends)}, remote {remote.backends}",
            param="backend",
        )
    return usable[0]


def probe_shm(remote: KvEndpoint) -> bool:
    """Can this process map the receiver's shm probe and read its token?"""
    if not remote.shm_probe or not remote.shm_token:
        return False
    token = remote.shm_token.encode()
    try:
        segment = ShmSegment.attach(remote.shm_probe)
    except (OSError, ValueError):
        return False
    with contextlib.closing(segment):
        return segment.size >= len(token) and bytes(segment.buf[: len(token)]) == token

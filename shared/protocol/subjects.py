"""Every NATS subject, stream and bucket name kvpath uses, built in one place.

All subjects live under `kvpath.<namespace>.`; ids that become subject tokens are checked so a stray '.',
'*' or '>' can never widen a subscription.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")
REMOTEKV_OPS = ("info", "put", "commit", "get", "exist")


def check_token(value: str | int, what: str = "id") -> str:
    text = str(value)
    if not _TOKEN.match(text):
        raise ValueError(f"{what} {text!r} cannot be a subject token (letters, digits, '_' and '-' only)")
    return text


class Subjects:
    """Subject names of one namespace."""

    __slots__ = ("namespace", "prefix")

    def __init__(self, namespace: str) -> None:
        self.namespace = check_token(namespace, "namespace")
        self.prefix = f"kvpath.{namespace}"

    # -- load reports: publish, ~10 Hz and on change
    def load(self, role: str, service_id: str) -> str:
        return f"{self.prefix}.load.{check_token(role, 'role')}.{check_token(service_id)}"

    @property
    def load_all(self) -> str:
        return f"{self.prefix}.load.>"

    def load_storage(self, node: int) -> str:
        return f"{self.prefix}.load.storage.{check_token(node, 'node')}"

    # -- tasks: request/ack, scheduler -> engine
    def task(self, engine_id: str) -> str:
        return f"{self.prefix}.task.{check_token(engine_id)}"

    # -- token streams: publish, engine -> router, one message per engine step per router
    def tokens(self, router_id: str) -> str:
        return f"{self.prefix}.tokens.{check_token(router_id)}"

    # -- token resends: request/reply, router -> engine (a token batch NATS lost)
    def resend(self, engine_id: str) -> str:
        return f"{self.prefix}.resend.{check_token(engine_id)}"

    # -- bus probe: publish, a service to itself through the nats-server (is the bus carrying messages?)
    def ping(self, service_id: str) -> str:
        return f"{self.prefix}.ping.{check_token(service_id)}"

    # -- aborts: publish, anyone -> every engine
    @property
    def abort(self) -> str:
        return f"{self.prefix}.abort"

    # -- KV events: JetStream stream, one subject per source
    def kv_events(self, source: str) -> str:
        return f"{self.prefix}.kv.events.{check_token(source)}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kv.events.>"

    @property
    def kv_events_stream(self) -> str:
        return f"KVPATH_{self.namespace.replace('-', '_')}_KV_EVENTS"

    # -- metadata index
    @property
    def index_match(self) -> str:
        return f"{self.prefix}.index.match"

    @property
    def index_stats(self) -> str:
        return f"{self.prefix}.index.stats"

    # -- storage service of a node
    def storage_read(self, node: int) -> str:
        return f"{self.prefix}.storage.{check_token(node, 'node')}.read"

    def storage_write(self, node: int) -> str:
        return f"{self.prefix}.storage.{check_token(node, 'node')}.write"

    def storage_control(self, node: int) -> str:
        return f"{self.prefix}.storage.{check_token(node, 'node')}.control"

    # -- remote KV store (the RDMA-pool baseline): request/reply, op in REMOTEKV_OPS
    def remotekv(self, store_id: str, op: str) -> str:
        if op not in REMOTEKV_OPS:
            raise ValueError(f"remote KV store op {op!r} is not one of {', '.join(REMOTEKV_OPS)}")
        return f"{self.prefix}.remotekv.{check_token(store_id, 'store_id')}.{op}"

    # -- KV data plane (transfer notices between engines)
    def transfer(self, engine_id: str) -> str:
        return f"{self.prefix}.transfer.{check_token(engine_id)}"

    # -- move the query: route sessions with a holder engine (shared/protocol/movequery.py)
    def route(self, engine_id: str) -> str:
        return f"{self.prefix}.route.{check_token(engine_id)}"

    # -- CXL-RPC of a Beluga pool over NATS (clients on other hosts; same ops as the shared-memory rings)
    def cxl_rpc(self, pool_id: str) -> str:
        return f"{self.prefix}.cxl.rpc.{check_token(pool_id, 'pool id')}"

    # -- registry of live services (JetStream KV bucket)
    @property
    def registry_bucket(self) -> str:
        return f"kvpath_{self.namespace.replace('-', '_')}_services"

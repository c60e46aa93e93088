"""Move the query, not the cache: what a requester engine, a holder engine and the router exchange.

A holder engine keeps chunks (a prompt's leading full blocks) pinned in its cache and announces them in the
index as location `held:<engine>` (one KV event per chunk, under the chunk's block hashes). The router puts a
`HeldPrefix` into the plan of a request whose prompt starts with such a chunk and that it sends to another
engine, with the primitive its cost model chose (route, fetch or local) and what to fall back to.

Route, per request (`route.<holder>`, request/reply on NATS, small records only):
  requester -> holder  `RouteOpen`: serve partial attention over the first `num_blocks` blocks of the chunk
                       whose block `num_blocks - 1` hashes to `chunk_hash`; replies go into `reply`
  holder -> requester  `RouteOpened`: write query rows into `queries` (an extent of the holder's region)
  requester -> holder  `RouteClose` when the request is done (or fell back); the holder frees the session
Per layer of every forward (the KV data plane, shared/transport: a one-sided write, then a notice), for all
the routed requests of one forward that route to the same holder at once (a "group"; its first request leads):
  requester -> holder  one write: each request's query rows, bytes of [T, H, dk] in the cache dtype, at the
                       start of its own `queries` extent; notice tag the lead's `queries.slot`, meta
                       `PartialQueries` (per request: request id, step, layer, tokens)
  holder -> requester  one attention call for the group, then one write: each request's (o, m, l) fp32
                       [T, H, dv + 2] at the start of its own `reply` extent; notice tag the lead's
                       `reply.slot`, meta `PartialReplies` (a request's `error` set, and no bytes for it, when
                       its query was refused: wrong size, layer out of order, NaN rows, not a session of the
                       lead's requester, holder overloaded; the batch's `error` refuses them all)
A requester sends layer l + 1 only after the reply to layer l arrived, so each extent (and each notice tag)
holds one layer at a time; step and layer travel in the meta and must come in order. One write and one
notice per group and layer, not per request, is what keeps a requester decoding many routed sub-agents from
spending a message per request, layer and step.
"""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any

from shared.protocol.codec import Message, message

PRIMITIVES = ("route", "fetch", "local")
HELD_TIER = "held"  # index location `held:<engine id>`
CHUNK_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's name of a chunk (`kv_chunk` extension)


def held_location(engine_id: str) -> str:
    return f"{HELD_TIER}:{engine_id}"


@message
class HeldPrefix(Message):
    """In a request's `KvPlan`: its first `num_blocks` blocks are a chunk engine `holder_id` holds, and how
    the router chose to use it. `fallback` is what the requester does when the route fails (fetch: read the
    chunk from the store, which holds `num_store_blocks` leading blocks; local: recompute it)."""

    KIND = "held_prefix"
    holder_id: str
    num_blocks: int
    primitive: str  # one of PRIMITIVES
    fallback: str = "local"  # fetch | local
    num_store_blocks: int = 0
    take_s: float = 0.0  # the cost model's price of taking the chunk here (min of fetch and local), seconds
    local_step_s: float = 0.0  # its price of one decode step attending the chunk here, seconds


@message
class RouteBuffer(Message):
    """An extent of a registered data-plane region and the notice slot that goes with it."""

    KIND = "route_buffer"
    engine_id: str
    endpoint: dict[str, Any]  # the receiver's KvEndpoint (shared.transport)
    region: str
    offset: int
    size_bytes: int
    slot: int


@message
class RouteOpen(Message):
    KIND = "route_open"
    request_id: str
    chunk_hash: int  # hash of the chunk's block num_blocks - 1 (the chain names all blocks before it)
    num_blocks: int
    fingerprint: str  # the requester's KV format: the holder refuses another one
    query_bytes_per_token: int  # H x dk x dtype bytes: what the requester will send per token
    max_query_tokens: int  # the most tokens of one layer's query (its largest prefill chunk)
    reply: RouteBuffer
    sender_id: str  # the requester's data-plane sender (the holder's waits fail when it goes)
    deadline_unix_s: float


@message
class RouteOpened(Message):
    KIND = "route_opened"
    queries: RouteBuffer
    sender_id: str  # the holder's data-plane sender (the requester's waits fail when it goes)
    num_layers: int
    partial_bytes_per_token: int  # H x (dv + 2) x 4
    queue_s: float = 0.0  # how long the holder's queue holds an exchange now


@message
class RouteClose(Message):
    KIND = "route_close"
    request_id: str


@message
class PartialQuery(Message):
    """One request's part of a `PartialQueries` notice (requester -> holder)."""

    KIND = "partial_query"
    RANGES = {"step": (0, None), "layer": (0, None), "num_tokens": (1, None)}
    request_id: str
    step: int
    layer: int
    num_tokens: int


@message
class PartialQueries(Message):
    """Notice meta of a group's query rows for one layer: one item per request, in the order written."""

    KIND = "partial_queries"
    items: list[PartialQuery] = field(default_factory=list)


@message
class PartialReply(Message):
    """One request's part of a `PartialReplies` notice; `error` set: refused, no bytes written for it."""

    KIND = "partial_reply"
    request_id: str
    step: int
    layer: int
    num_tokens: int
    error: str = ""
    queue_s: float = 0.0  # time the query waited for the holder's attention call
    compute_s: float = 0.0  # the call itself (shared with the requests batched into it)


@message
class PartialReplies(Message):
    """Notice meta of a group's partials (holder -> requester), the items in the queries' order; `error` set:
    the whole notice was refused (malformed, sizes that do not add up) and no bytes were written."""

    KIND = "partial_replies"
    items: list[PartialReply] = field(default_factory=list)
    error: str = ""


@message
class HeldChunkInfo(Message):
    """A held chunk as the holder's registry entry lists it (`ServiceInfo.extra["held_chunks"]`)."""

    KIND = "held_chunk_info"
    chunk_hash: int
    num_tokens: int
    num_sessions: int = 0
    last_used_unix_s: float = 0.0
    names: list[str] = field(default_factory=list)  # the clients' names of it (pinned while it has one)
    tenant: str = ""  # whose names they are
    engine_id: str = ""  # its holder (set in `ChunkList` replies)


def check_chunk_name(name: str) -> str:
    if not CHUNK_NAME.fullmatch(name):
        raise ValueError(f"a chunk name is 1 to 128 of A-Z a-z 0-9 . _ : -, got {name[:140]!r}")
    return name


@message
class ChunkName(Message):
    """A client's name for a chunk, within its tenant (the `kv_chunk` request extension). In a request's plan:
    the engine keeps the prompt's leading full blocks as a held chunk under this name, pinned (never evicted
    to make room) until `ChunkUnpin`; the name moves off any chunk it named before on that engine."""

    KIND = "chunk_name"
    name: str
    tenant: str = ""

    def check(self) -> None:
        check_chunk_name(self.name)


@message
class ChunkUnpin(Message):
    """router -> holder (`route.<engine>`): drop the name; a chunk left without names and sessions is freed
    now. Reply: `ChunkList` of the chunks that carried it."""

    KIND = "chunk_unpin"
    chunk: ChunkName


@message
class ChunkQuery(Message):
    """router -> holder (`route.<engine>`): the tenant's named chunks. Reply: `ChunkList`."""

    KIND = "chunk_query"
    tenant: str = ""


@message
class ChunkList(Message):
    KIND = "chunk_list"
    chunks: list[HeldChunkInfo] = field(default_factory=list)

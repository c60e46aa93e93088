"""Router -> engine tasks and the engine <-> engine records of disaggregated serving.

Every task carries one `RequestPlan`, built once by the router: the prompt's token ids, the chained hashes of
its full blocks (computed once, by the router, with the KV format the engines announced), how many leading
blocks are stored and on which side they are read, the sampling parameters and the deadline. Engines take
the plan as it is (verifying the hashes' ends, not recomputing the chain); the three task kinds add only
what their role needs.

Flow of one disaggregated request (DualPath brief §3.3-3.5):
  1. router -> DE `DecodeTask` (task.<de>): the DE reserves its buffer for the whole prompt's KV (Full Block
     layout) and, when the read side is the DE, starts reading the stored prefix into its node buffer. Its
     `TaskAck` names the buffer (`BufferRef`) the PE must write into.
  2. router -> PE `PrefillTask` (task.<pe>), carrying that buffer. Read side PE: the PE reads the prefix from
     its own node's storage. Read side DE: the PE reserves a receive area and asks the DE with `PullHits`
     (transfer.<de>); the DE answers once its read is done and streams Layer Blocks into it (a failed stream
     ends with a `HitStreamFailed` notice).
  3. The PE prefills layer by layer, streaming each layer's KV to the DE buffer (hit + miss on the PE path,
     miss only on the DE path), samples the first token, publishes it (a `TokenDelta` with `handoff`), and
     posts `PrefillDone` to the DE as the DONE notice of the buffer.
  4. The DE loads the prompt KV into its cache, frees its buffer, decodes, persists filled blocks.
Notices travel on the KV data plane (`shared.transport`), not on NATS: their metadata is an encoded record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from shared.protocol.codec import U64_MAX, Message, message
from shared.protocol.messages import SamplingParams
from shared.protocol.movequery import ChunkName, HeldPrefix
from shared.protocol.subjects import check_token

MAX_ID_CHARS = 256

# hbm: streamed from the decode engine's resident cache (AMPD); pool: the engine that prefills reads the KV
# pool first (Beluga), storage on its node below it
READ_SIDES = ("", "pe", "de", "hbm", "pool")


def choice_request_id(request_id: str, index: int) -> str:
    """The request id of choice `index` of a request with n choices (choice 0 keeps the request's own)."""
    return request_id if index == 0 else f"{request_id}-{index}"


@message
class KvPlan(Message):
    """A prompt's blocks as the router sees them.

    `block_hashes`: one chained hash per full block of the prompt (`len(prompt) // block_size` of them),
    salted with the fingerprint the engines announced. `num_hit_blocks`: the leading blocks to load instead
    of computing (stored, and never more than `shared.blocks.max_hit_blocks`). `read_side`: disaggregated
    serving only, whose node reads them ("pe" | "de"; "" reads nothing), "hbm": the decode engine streams
    them from a session's KV resident in its cache (AMPD), or "pool": the engine that prefills (a PE, or a
    session decode engine's local turn) reads the longest prefix the KV pool holds, then storage for the rest
    of `num_hit_blocks`.
    """

    KIND = "kv_plan"
    RANGES = {"block_hashes": (0, U64_MAX), "num_hit_blocks": (0, None), "salt": (0, U64_MAX)}
    block_hashes: list[int] = field(default_factory=list)
    num_hit_blocks: int = 0
    read_side: str = ""
    salt: int = 0  # the chain's salt (shared.hashing.kv_salt: tenant and cache_salt); 0: unsalted
    held: HeldPrefix | None = None  # the prompt starts with a chunk another engine holds (movequery.py)

    def with_hits(self, num_hit_blocks: int = 0, read_side: str = "") -> KvPlan:
        """The same prompt's plan loading `num_hit_blocks` from `read_side`: its hashes, salt and held prefix
        kept (a plan rebuilt from the hashes alone loses the salt, and the engine rejects the chain)."""
        return dataclasses.replace(self, num_hit_blocks=num_hit_blocks, read_side=read_side)

    def check(self) -> None:
        if self.num_hit_blocks > len(self.block_hashes):
            raise ValueError(f"num_hit_blocks {self.num_hit_blocks} > {len(self.block_hashes)} block hashes")
        if self.read_side not in READ_SIDES:
            raise ValueError(f"read_side {self.read_side!r} is not one of {READ_SIDES}")


@message
class RequestPlan(Message):
    """Everything an engine needs of one request, in every task kind."""

    KIND = "request_plan"
    RANGES = {
        "prompt_token_ids": (0, None),  # and below the vocabulary size (the engine checks, it knows it)
        "num_resumed_tokens": (0, None),
        "deadline_unix_s": (0.0, None),  # and not already passed (the engine checks on admission)
        "ttft_slo_s": (0.0, None),
        "itl_slo_s": (0.0, None),
    }
    request_id: str
    router_id: str  # token deltas go to tokens.<router_id>
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline_unix_s: float
    session_id: str = ""
    kv: KvPlan = field(default_factory=KvPlan)
    ttft_slo_s: float = 0.0  # the request's SLOs (AMPD: prefill reordering); 0: none given
    itl_slo_s: float = 0.0
    pin: ChunkName | None = None  # move the query: keep the prompt as a held chunk under this name
    # a request migrated off a lost engine: the prompt ends with the output the client got so far, this
    # many tokens of it. For its KV they are prompt (stored blocks of them hit); for sampling they are
    # output (grammar, seeded generator and penalties catch up on them: services/router/redispatch.py)
    num_resumed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def choice(self, index: int) -> RequestPlan:
        """The plan of choice `index` of `sampling.n`: its own request id and seed, the same prompt and KV."""
        request_id = choice_request_id(self.request_id, index)
        return dataclasses.replace(self, request_id=request_id, sampling=self.sampling.choice(index))

    def check(self) -> None:
        check_token(self.router_id, "router id")  # deltas go to tokens.<router_id>: never a wildcard
        if not self.request_id or len(self.request_id) > MAX_ID_CHARS:
            raise ValueError(f"request_id must have 1 to {MAX_ID_CHARS} characters")
        if self.num_resumed_tokens >= len(self.prompt_token_ids):
            raise ValueError("num_resumed_tokens must leave at least one token of the original prompt")
        if self.num_resumed_tokens and self.sampling.n > 1:
            raise ValueError("a migrated request samples one choice (each choice migrates alone)")


@dataclasses.dataclass(slots=True, kw_only=True)
class Task(Message):
    """Base of the three task kinds (`task.<engine>`, request/ack): the plan and the router's stage timings
    so far (seconds by stage; they travel on to the first token delta)."""

    VERSION = 2
    plan: RequestPlan
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.plan.request_id


@message
class GenerateTask(Task):
    """Colocated engine: prefill and decode the request, loading its stored prefix from the own node."""

    KIND = "generate_task"


@message
class BufferRef(Message):
    """Where a peer must write: an extent of a registered transport region, and its notice tag base."""

    KIND = "buffer_ref"
    engine_id: str
    endpoint: dict[str, Any]  # the receiver's KvEndpoint (shared.transport)
    region: str
    offset: int
    slot: int  # notices for this extent use tags slot * TAGS_PER_SLOT + layer (services/engine/receive_area)
    num_blocks: int
    num_kept_blocks: int = 0  # leading blocks the owner holds already (a session's resident KV): not written


@message
class DecodeTask(Task):
    """Decode engine: reserve the buffer the PE writes the prompt's KV into, then decode."""

    KIND = "decode_task"
    pe_id: str


@message
class PrefillTask(Task):
    """Prefill engine: prefill layer by layer into the DE's buffer, sample the first token, hand off."""

    KIND = "prefill_task"
    de_buffer: BufferRef
    is_layerwise: bool = True  # False: the Basic baseline (whole prefix loaded before compute)


@message
class TaskAck(Message):
    """An engine's answer to a task. Refused: `code`/`message` say why (a `shared.errors` code). A decode
    engine that accepts names its buffer."""

    KIND = "task_ack"
    VERSION = 2
    request_id: str
    accepted: bool
    code: str = ""
    message: str = ""
    buffer: BufferRef | None = None


@message
class PullHits(Message):
    """PE -> DE (transfer.<de>): stream the stored prefix you read into my receive area."""

    KIND = "pull_hits"
    request_id: str
    pe_buffer: BufferRef


@message
class PullHitsReply(Message):
    KIND = "pull_hits_reply"
    request_id: str
    num_blocks: int  # leading prefix blocks the DE read (and will stream); may be < asked
    read_s: float = 0.0


@message
class PrefillDone(Message):
    """PE -> DE, the DONE notice of the DE buffer: the prompt's KV is complete (or never will be).

    `first_token` None means the prefill failed (`error` says why). `finish_reason` set: the first token
    ended the request on the PE, the DE only frees its buffer. `num_loaded_blocks`: leading blocks loaded from
    storage on the PE path (already stored, so the DE does not persist them again)."""

    KIND = "prefill_done"
    first_token: int | None = None
    finish_reason: str = ""
    num_loaded_blocks: int = 0
    error: str = ""


@message
class HitStreamFailed(Message):
    """DE -> PE, the notice of every layer the DE could not stream (the PE recomputes nothing: it fails)."""

    KIND = "hit_stream_failed"
    error: str

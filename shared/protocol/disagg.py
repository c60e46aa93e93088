"""Messages of disaggregated serving (DualPath): router -> DE, router -> PE, PE -> DE.

Flow of one request (brief §3.3-3.5):
  1. router -> DE `DecodeTask` (task.<de>): the DE reserves its buffer for the whole prompt's KV (Full Block
     layout) and, when the read side is the DE, starts reading the stored prefix into its node buffer. It
     answers `DecodeAck` naming where the PE must write.
  2. router -> PE `PrefillTask` (task.<pe>), carrying the DE's buffer location. Read side PE: the PE reads
     the prefix from its own node's storage. Read side DE: the PE reserves a receive area and asks the DE
     with `PullHits` (transfer.<de>); the DE answers once its read is done and streams Layer Blocks into it.
  3. The PE prefills layer by layer, streaming each layer's KV to the DE buffer (hit + miss on the PE path,
     miss only on the DE path), samples the first token, publishes it (a `TokenDelta` with `handoff`), and
     posts the DONE notice to the DE.
  4. The DE loads the prompt KV into its cache, frees its buffer, decodes, persists filled blocks.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from shared.protocol.codec import Message, message
from shared.protocol.messages import SamplingParams


@message
class BufferRef(Message):
    """Where a peer must write: an extent of a registered transport region, and its notice tag base."""

    KIND = "buffer_ref"
    engine_id: str
    endpoint: dict[str, Any]  # the receiver's KvEndpoint (shared.transport)
    region: str
    offset: int
    slot: int  # notices for this extent use tags slot * TAGS_PER_SLOT + layer (see services/engine/disagg)
    num_blocks: int


@message
class DecodeTask(Message):
    KIND = "decode_task"
    request_id: str
    router_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline_unix_s: float
    pe_id: str
    read_side: str = ""  # "pe" | "de" | "" (no stored prefix is read)
    num_hit_blocks: int = 0
    session_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)


@message
class DecodeAck(Message):
    KIND = "decode_ack"
    request_id: str
    accepted: bool
    code: str = ""
    message: str = ""
    buffer: BufferRef | None = None


@message
class PrefillTask(Message):
    KIND = "prefill_task"
    request_id: str
    router_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline_unix_s: float
    de_buffer: BufferRef
    read_side: str = ""
    num_hit_blocks: int = 0
    is_layerwise: bool = True  # False: the Basic baseline (whole prefix loaded before compute)
    session_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # router stages so far (schedule, allocate)


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

"""Per-request state inside an engine (pure data)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from shared.protocol import SamplingParams


class SeqStatus(enum.Enum):
    PREPARING = "preparing"  # accepted; its stored prefix is being fetched
    WAITING = "waiting"  # queued, no KV allocated
    RUNNING = "running"  # has blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: str
    router_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline_unix_s: float
    arrived_at: float  # engine monotonic clock
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this engine's cache
    num_cached_tokens: int = 0  # prompt tokens whose KV was loaded instead of computed (usage.cached_tokens)
    num_hit_tokens: int = 0  # stored-prefix tokens ready to load in the first chunk (whole blocks)
    status: SeqStatus = SeqStatus.PREPARING
    finish_reason: str | None = None
    error_code: str = ""
    error_message: str = ""
    next_delta_seq: int = 0
    unsent_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    kv_plan: dict = field(default_factory=dict)  # the router's KV plan (stored prefix to load)
    trace: Any = None  # services.engine.tracing.SeqTrace while tracing is on, else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV must exist before decoding: all but the last sampled token."""
        return self.num_tokens - (1 if self.output_token_ids else 0)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

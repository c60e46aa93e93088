"""One request inside an engine: the router's plan and every piece of engine state that belongs to it.

A `Sequence` is the one owner of a request's engine-side state: its place in the scheduler, its cache
blocks, its output, its pending abort, the background task fetching its prefix, the wait its last token
delta is held for, and the KV connector's record (`kv_state`: read leases, buffer extents, blocks persisted).
`EngineCore.seqs` is the only map keyed by request id, and `EngineCore._finish` frees all of it in one place.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from shared.protocol import RequestPlan, SamplingParams


class SeqStatus(enum.Enum):
    PREPARING = "preparing"  # accepted; its stored prefix is being fetched
    WAITING = "waiting"  # queued, no KV allocated
    RUNNING = "running"  # has blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Identity semantics: one object per request, hashable by identity."""

    plan: RequestPlan
    arrived_at: float  # engine monotonic clock
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # chained hashes of the full blocks so far: the plan's (the prompt's), extended as generated tokens fill
    # blocks (services/engine/persist.py); block i's hash names tokens [0, (i + 1) * block_size)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this engine's cache
    num_cached_tokens: int = 0  # prompt tokens whose KV was loaded instead of computed (usage.cached_tokens)
    num_hit_tokens: int = 0  # stored-prefix tokens ready to load in the first chunk (whole blocks)
    status: SeqStatus = SeqStatus.PREPARING
    finish_reason: str | None = None
    error_code: str = ""
    error_message: str = ""
    error_engine: str = ""  # a peer engine whose loss failed the request (the PE of a hand-off)
    abort_reason: str = ""  # set by an abort; applied between steps
    next_delta_seq: int = 0
    unsent_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    rng: random.Random | None = None  # the seeded request's sampling generator
    grammar: Any = None  # gpu.grammar.GrammarState of a constrained request (response_format, forced tools)
    sampled_logprobs: list[Any] = field(default_factory=list)  # the sampler's entry for the last token
    unsent_logprobs: list[Any] = field(default_factory=list)  # entries of unsent_token_ids, in order
    prepare_task: asyncio.Task[None] | None = None  # the connector's prefix fetch, until it is done
    final_wait: Awaitable[None] | None = None  # the last delta goes out once this is done (blocks durable)
    kv_state: Any = None  # the KV connector's record of the request; only the connector reads it
    trace: Any = None  # services.engine.tracing.SeqTrace while tracing is on, else None
    route: Any = None  # move the query: its route session or held-chunk import (services/engine/route.py)
    num_postponed: int = 0  # times overtaken in this engine's prefill queue (AMPD's Algorithm 2 caps it)
    postponed_tokens: int = 0  # compute admitted ahead of it (shortest-first order caps it)
    # choices 1..n-1 of a request with n > 1 (choice 0 is this sequence): they wait, PREPARING, until this
    # one's prompt is prefilled, then fork its block table and sample their first token from the same logits
    # (EngineCore._fork); empty once forked
    pending_choices: list[Sequence] = field(default_factory=list)
    choice_of: Sequence | None = None  # choice 0, while this choice waits for it (no connector record yet)
    may_share_blocks: bool = False  # forked: blocks may have other owners (copied before written)

    def __post_init__(self) -> None:
        if not self.block_hashes:
            self.block_hashes = list(self.plan.kv.block_hashes)
        if self.rng is None and self.plan.sampling.seed is not None:
            self.rng = random.Random(self.plan.sampling.seed)

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def router_id(self) -> str:
        return self.plan.router_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.plan.prompt_token_ids

    @property
    def sampling(self) -> SamplingParams:
        return self.plan.sampling

    @property
    def deadline_unix_s(self) -> float:
        return self.plan.deadline_unix_s

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.plan.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.plan.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV must exist before decoding: all but the last sampled token."""
        return self.num_tokens - (1 if self.output_token_ids else 0)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt = self.plan.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]

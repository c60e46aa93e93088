"""One simulated request (an agent turn) and the times it passes: the TTFT breakdown's stage boundaries."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.policy.snapshot import PendingRequest, ReadSide

NAN = math.nan


@dataclass(slots=True, eq=False)
class SimRequest:
    """Times are simulated seconds; NaN until reached. Stages: schedule (arrival -> placed), allocate
    (-> DRAM buffers held), read (-> hit KV in the read side's buffer), prefill (-> first token, PE queueing
    included)."""

    agent: int
    turn: int
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    pending: PendingRequest
    arrival_s: float
    placed_s: float = NAN
    allocated_s: float = NAN
    read_done_s: float = NAN
    first_token_s: float = NAN
    second_token_s: float = NAN
    finish_s: float = NAN
    # where it was placed: positions in the cluster's engine lists (-1: not placed yet) and their nodes
    pe_index: int = -1
    de_index: int = -1
    pe_node: int = -1
    de_node: int = -1
    read_side: ReadSide | None = None
    read_node: int = -1
    read_tokens: int = 0
    pe_buffer_bytes: float = 0.0
    de_buffer_bytes: float = 0.0
    decode_target: float = 0.0  # the DE's virtual token clock value at which it finishes

    @property
    def request_id(self) -> str:
        return self.pending.request_id

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def record(self) -> tuple[float, ...]:
        """The numbers results need, in `RECORD_FIELDS` order."""
        side = 0.0 if self.read_side is None else (1.0 if self.read_side is ReadSide.PE else 2.0)
        return (
            float(self.agent),
            float(self.turn),
            self.arrival_s,
            self.placed_s,
            self.allocated_s,
            self.read_done_s,
            self.first_token_s,
            self.second_token_s,
            self.finish_s,
            float(self.prompt_tokens),
            float(self.hit_tokens),
            float(self.gen_tokens),
            side,
        )


RECORD_FIELDS = (
    "agent",
    "turn",
    "arrival_s",
    "placed_s",
    "allocated_s",
    "read_done_s",
    "first_token_s",
    "second_token_s",
    "finish_s",
    "prompt_tokens",
    "hit_tokens",
    "gen_tokens",
    "read_side",  # 0 none, 1 PE, 2 DE
)

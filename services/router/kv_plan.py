"""The router's KV plan for a request: how much of the prompt's prefix is stored (asks the index)."""

from __future__ import annotations

import logging

from services.router import metrics
from services.router.prompts import PreparedPrompt
from shared import telemetry
from shared.bus import Bus
from shared.errors import KvpathError
from shared.hashing import block_hashes
from shared.kvclient import IndexClient

log = logging.getLogger(__name__)


class KvPlanner:
    """Hashes a prompt's full blocks and asks the index for the longest stored prefix.

    At most (prompt_len - 1) // block_size blocks count: one prompt token is always computed to sample the
    first output token. An index that is down or slow is a miss (the request recomputes), counted by outcome.
    """

    def __init__(self, bus: Bus, *, fingerprint: str, block_size: int, timeout_s: float) -> None:
        self.index = IndexClient(bus)
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.timeout_s = timeout_s

    def hashes(self, token_ids: list[int]) -> list[int]:
        usable = (len(token_ids) - 1) // self.block_size
        return block_hashes(token_ids[: usable * self.block_size], self.block_size, self.fingerprint)

    async def plan(self, prompt: PreparedPrompt, request_id: str) -> dict:
        hashes = self.hashes(prompt.token_ids)
        if not hashes:
            return {}
        with telemetry.span("index.lookup") as span:
            try:
                result = await self.index.match(hashes, timeout_s=self.timeout_s)
            except KvpathError as exc:
                metrics.INDEX_LOOKUPS.labels("error").inc()
                log.warning("index lookup failed request_id=%s: %s", request_id, exc.message)
                if span is not None:
                    span.set_attributes({"outcome": "error", "error.code": exc.code})
                return {}
            if span is not None:
                span.set_attributes(
                    {"num_prompt_blocks": len(hashes), "num_hit_blocks": result.num_hit_blocks}
                )
        metrics.INDEX_LOOKUPS.labels("hit" if result.num_hit_blocks else "miss").inc()
        log.debug(
            "index lookup request_id=%s hit_blocks=%d/%d", request_id, result.num_hit_blocks, len(hashes)
        )
        return {"num_hit_blocks": result.num_hit_blocks, "num_prompt_blocks": len(hashes)}

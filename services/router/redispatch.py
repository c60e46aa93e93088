"""Dispatching a request again when the attempt serving it was lost: before any token reached the client,
or mid-decode (a migration).

An engine that dies or restarts after taking a request (the router hears its silence or its new incarnation:
`StreamTable.fail_engine`), or a decode engine whose KV data plane to its prefill engine breaks (that engine
died mid-prefill: a `transport_error` delta), ends the attempt; while the client has received no token the
request is not lost with it: `RouterCore` aborts the attempt under every id the engines knew it by and sends
the request again through the same dispatch, under an id of its own (`<id>-lostN`, so the abort never meets
it), up to `max_redispatches` times (RouterConfig, default 2; 0: never) within the request's deadline. The
dispatch decides afresh over the engines its table still lists (a silent engine is out of it; a dead peer
not yet heard is met at its send and left out, as any failed send). The n choices of a request sent as
one task each go on alone, as a request of one choice with its own id and seed (`ChoiceGroup.again`).

After tokens went out, the request migrates: the new attempt's prompt is the old one followed by the tokens
the client got (`RequestPlan.num_resumed_tokens` of them), max_tokens and min_tokens less those. For its KV
they are prompt, so every dispatch takes it as a new request (colocated, AMPD session, DualPath prefill and
decode, auto) and the blocks of them that the lost engine stored are loaded instead of recomputed; for
sampling they are output, so its engine catches a grammar, a seeded generator and the penalties up on them
and samples on: the stream continues where it broke, with the tokens the lost engine would have given
(greedy, or seeded). As Dynamo's request migration does. A request pinning a held chunk (`kv_chunk`) is
not migrated: its prompt is the chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from services.router import metrics
from services.router.dispatch import Dispatch, fresh_plan, publish_abort
from services.router.engine_return import dispatch_or_wait
from services.router.kv_plan import KvPlanner
from services.router.streams import RequestStream, StreamTable
from shared.errors import KvpathError
from shared.protocol import KvFormat, KvPlan, RequestPlan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Redispatch:
    """What sending a request again takes: its plan as first built (dispatches rewrite `plan.kv`), where
    its prefix lies, and the id of the attempt the engines know now."""

    plan: RequestPlan
    locality: Mapping[str, int]
    task_id: str
    limit: int  # how many lost attempts the request survives (`RouterConfig.max_redispatches`)
    count: int = 0
    output: list[int] = field(default_factory=list)  # the tokens the client got so far (a migration's resume)
    resumed: int = 0  # how many of them the current attempt's prompt ends with

    def record(self, token_ids: list[int]) -> int:
        """Keep a delta's tokens (what a migration resumes from); return how many."""
        self.output += token_ids
        return len(token_ids)

    @classmethod
    def of(cls, plan: RequestPlan, locality: Mapping[str, int], limit: int) -> Redispatch:
        """Kept before the first dispatch, which may rewrite the plan's KV part."""
        return cls(fresh_plan(plan), locality, plan.request_id, limit)

    def may(self, deadline: float) -> bool:
        """Another attempt is allowed: retries left, time left, and tokens left to generate (a request
        pinning a held chunk only before its first token)."""
        left = len(self.output) < self.plan.sampling.max_tokens and not (self.output and self.plan.pin)
        return self.count < self.limit and time.monotonic() < deadline and left

    async def send(
        self,
        dispatch: Dispatch,
        streams: StreamTable,
        stream: RequestStream,
        deadline: float,
        cause: str,
        kv: tuple[KvPlanner, KvFormat | None],
    ) -> bool:
        """Abort the lost attempt, restart the stream under a new id and dispatch the request again. A
        migration no engine took returns False (the client gets the loss that caused it, not the refusal);
        a first-token retry's refusal is raised (a 503 when no engine is left). `kv`: what plans the
        migrated prompt's KV, and the engines' KV format (set by their first report, never unset)."""
        planner, kv_format = kv
        if self.output and kv_format is None:
            return False
        for task_id in stream.task_ids:
            await publish_abort(dispatch.bus, task_id, f"{cause}; dispatched again")
        dispatch.release(self.task_id)
        self.count += 1
        self.task_id = f"{stream.request_id}-lost{self.count}"
        streams.restart(stream.request_id, self.task_id)
        metrics.REDISPATCHED.labels("migrated" if self.output else "engine_lost").inc()
        log.warning(
            "%s request_id=%s (%s): dispatched again as %s",
            f"migrated after {len(self.output)} tokens" if self.output else "lost before the first token",
            stream.request_id,
            cause,
            self.task_id,
        )
        plan, locality = fresh_plan(self.plan), self.locality
        plan.request_id = self.task_id
        if self.output and kv_format is not None:  # where the prefix and the output so far lie now
            tokens = self.plan.prompt_token_ids + self.output
            planned = await planner.plan(tokens, kv_format, self.task_id, self.plan.kv.salt)
            plan, locality = resumed_plan(plan, self.output, planned.kv), planned.blocks_by_location
        self.resumed = plan.num_resumed_tokens
        try:
            await dispatch_or_wait(dispatch, plan, deadline, streams, locality)
        except KvpathError as exc:
            planner.decided(self.task_id)
            if not self.output:
                raise
            log.warning("migration failed request_id=%s: %s", stream.request_id, exc.message)
            return False
        return True


def resumed_plan(plan: RequestPlan, output: list[int], kv: KvPlan) -> RequestPlan:
    """The plan of a request migrated after `output` (fewer than its max_tokens): its prompt followed by
    the output, whose KV plan is `kv`, generating what is left."""
    sampling = replace(
        plan.sampling,
        max_tokens=plan.sampling.max_tokens - len(output),
        min_tokens=max(0, plan.sampling.min_tokens - len(output)),
    )
    tokens = plan.prompt_token_ids + output
    return replace(plan, prompt_token_ids=tokens, sampling=sampling, kv=kv, num_resumed_tokens=len(output))

"""A batched model step that fails takes down only the sequences at fault.

One request whose parameters pass admission but that fails inside the model (a kernel error on its shapes, a
fault of the sampler) must not fail the other requests of its batch. When a step raises, its parts run again
one at a time: each decode sequence alone, each computed prefill chunk alone; a part that fails again fails
its request, the others go on as if the step had succeeded. Retrying is safe for these parts because a step
writes KV only at the positions it computes (a retry writes the same values) and a token is sampled only
after the forward pass succeeded.

Not retried, failing with the step as before: load-only chunks (importing KV prefilled elsewhere consumes
its receive buffer), chunks that load a stored prefix layer by layer, and every part on a prefill engine
(its layers stream to the decode engine while they are computed).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from services.engine.scheduler import StepPlan
from services.engine.sequence import Sequence

log = logging.getLogger(__name__)

Execute = Callable[[StepPlan], Awaitable[dict[Sequence, int]]]


async def retry_alone(
    execute: Execute, plan: StepPlan, exc: Exception, role: str
) -> tuple[StepPlan, dict[Sequence, int], list[Sequence]]:
    """(the part of `plan` that ran, its sampled tokens, the sequences that failed, with their error set)."""
    retriable = role != "prefill"
    parts = [StepPlan(prefill=[c]) for c in plan.prefill if retriable and c.num_tokens and not c.load_tokens]
    parts += [StepPlan(decode=[s]) for s in plan.decode if retriable]
    in_parts = {c.seq for p in parts for c in p.prefill} | {s for p in parts for s in p.decode}
    failed = {c.seq: exc for c in plan.prefill if c.seq not in in_parts}
    failed |= {s: exc for s in plan.decode if s not in in_parts}
    if len(parts) + len(failed) <= 1:  # one sequence in the step: it is the one at fault
        failed |= dict.fromkeys(in_parts, exc)
        parts = []
    ran = StepPlan(preempted=plan.preempted)
    tokens: dict[Sequence, int] = {}
    for part in parts:
        try:
            tokens.update(await execute(part))
        except Exception as part_exc:
            seq = part.prefill[0].seq if part.prefill else part.decode[0]
            log.warning("request_id=%s fails alone: %r", seq.request_id, part_exc)
            failed[seq] = part_exc
        else:
            ran.prefill += part.prefill
            ran.decode += part.decode
    for seq, error in failed.items():
        seq.error_code = "engine_failed"
        seq.error_message = f"model step failed: {type(error).__name__}: {error}"
    return ran, tokens, list(failed)

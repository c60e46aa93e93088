"""The n choices of one request in an engine: one prefill of the prompt, n sequences after it (vLLM's fork).

A task whose `sampling.n` is above 1 becomes n sequences on admission: choice 0 carries the request (its id,
its prefill), choices 1..n-1 (`RequestPlan.choice(i)`: ids `<id>-<i>`, seeds `seed + i`) wait beside it,
PREPARING, in `Sequence.pending_choices`. The step that completes choice 0's prefill samples every choice's
first token from the same logits row (one batched sampler call, each row with its own generator, grammar and
log-probability sink); `fork` then gives each waiting choice choice 0's block table (the scheduler adds an
owner to every block) and runs it from the next step on, batched with the others. Blocks are never written
while shared: a choice about to write into a shared block gets a copy first (the scheduler's copy-on-write),
which happens only for the partly filled last prompt block.

DualPath: the prefill engine serves choice 0 alone (its connector does not fork: `forks_choices`); the
decode engine imports the prompt's KV once, for choice 0, and forks the other choices from it with the last
prompt token not yet computed: their next step recomputes that one token (into a private copy of its block)
and samples their first token, n - 1 one-token prefills batched into one step instead of n - 1 prompts.
Choice 0 may have ended on its PE (its first token was the last): the DE still imports the prompt for the
other choices, then lets choice 0 go.

After the fork every choice is an ordinary sequence: it is aborted, fails (alone), finishes and frees its
blocks (one owner each) by itself. Before it, the choices hang on choice 0: when choice 0 leaves (an abort,
a deadline, a failed prefill) they leave with it, with its error (`orphan`).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.engine.connector import KvConnector
from services.engine.scheduler import EngineScheduler, PrefillChunk
from services.engine.sequence import SeqStatus, Sequence


def pending(seq: Sequence) -> list[Sequence]:
    """The choices still waiting for `seq`'s prefill (those aborted meanwhile are left out)."""
    return [c for c in seq.pending_choices if c.status is not SeqStatus.FINISHED]


def fork(
    chunks: Iterable[PrefillChunk],
    sampled: dict[Sequence, int],
    scheduler: EngineScheduler,
    connector: KvConnector,
) -> list[Sequence]:
    """Fork the waiting choices of every sequence whose prompt is complete after this step: computed here
    (its first token is in `sampled`, theirs too: returned, to be emitted) or imported (a DE's load-only
    chunk: they recompute the last prompt token next step)."""
    forked: list[Sequence] = []
    for chunk in chunks:
        parent = chunk.seq
        is_imported = chunk.num_tokens == 0
        if not parent.pending_choices or not (is_imported or parent in sampled):
            continue
        for child in pending(parent):
            assert is_imported or child in sampled, "a choice's first token is sampled with choice 0's"
            computed = parent.num_prompt_tokens - (1 if is_imported else 0)
            scheduler.fork(parent, child, computed)
            connector.fork(parent, child)
            child.timings = dict(parent.timings)
            if not is_imported:
                forked.append(child)
        parent.pending_choices = []
    return forked


def orphan(seq: Sequence) -> list[Sequence]:
    """`seq` left before its prefill completed: its waiting choices leave too (with its error, or silently
    when it was aborted); the engine applies that with the aborts, between steps. Returns them."""
    orphans = pending(seq)
    for child in orphans:
        child.abort_reason = seq.abort_reason or "choice 0 left"
        if seq.finish_reason == "error" or seq.error_code:
            child.error_code = seq.error_code or "engine_failed"
            child.error_message = seq.error_message or "the request's prefill failed"
    seq.pending_choices = []
    return orphans

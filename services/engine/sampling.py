"""A sequence's sampling options: its parameters and the state it owns (generator, token history, grammar,
log-probability sink), as the model runner's sampler takes them each step; a new sequence with that state
checked and built; the tokens its next sample may not be."""

from __future__ import annotations

import time
from collections.abc import Iterable

from gpu.grammar import GrammarCompiler
from gpu.runner import SamplingOptions
from services.engine.sequence import Sequence
from shared.errors import InvalidRequestError
from shared.protocol import RequestPlan


def sampling_options(seq: Sequence) -> SamplingOptions:
    """The sampler's view of a request: its parameters and the state it owns (generator, history, grammar,
    log-probability sink)."""
    s = seq.sampling
    if seq.grammar is not None:
        seq.grammar.catch_up(seq.output_token_ids)  # a DE's first token was sampled by its PE
    output, resumed = seq.output_token_ids, seq.plan.num_resumed_tokens
    if resumed and (s.presence_penalty or s.frequency_penalty):  # they count a migrated request's output
        output = seq.prompt_token_ids[-resumed:] + output  # so far (the repetition penalty sees all tokens)
    return SamplingOptions(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=_logit_bias(s.logit_bias_ids, s.logit_bias_values),
        num_logprobs=s.logprobs,
        generator=seq.rng,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=output,
        grammar=seq.grammar,
        logprobs_out=seq.sampled_logprobs if s.logprobs >= 0 else None,
    )


def new_sequence(
    plan: RequestPlan, vocab_size: int, grammars: GrammarCompiler, choice_of: Sequence | None = None
) -> Sequence:
    """The sequence of a plan with its sampling state: options checked (a bad one refuses the task, never
    fails a batch), its generator seeded and its grammar compiled."""
    seq = Sequence(plan=plan, arrived_at=time.monotonic(), choice_of=choice_of)
    options = sampling_options(seq)
    options.check(vocab_size)
    if plan.sampling.grammar:
        seq.grammar = grammars.compile(plan.sampling.grammar)
    # migrated: the prompt ends with its output so far, which the grammar and a seeded generator catch up
    # on, so it samples on as it would have where it began
    resumed = plan.num_resumed_tokens
    if resumed:
        if seq.grammar is not None:
            seq.grammar.advance(plan.prompt_token_ids[-resumed:])
        if seq.rng is not None and not options.is_greedy:
            for _ in range(resumed):  # the draws its tokens so far took
                seq.rng.random()
    return seq


def banned_token_ids(seq: Sequence, eos_token_ids: Iterable[int]) -> list[int]:
    """Tokens the next sample may not be (-inf logits): EOS and stop tokens until `min_tokens` are out."""
    if len(seq.output_token_ids) >= seq.sampling.min_tokens:
        return []
    eos = [] if seq.sampling.ignore_eos else list(eos_token_ids)
    return eos + list(seq.sampling.stop_token_ids)


def _logit_bias(ids: list[int], values: list[float]) -> dict[int, float] | None:
    if len(ids) != len(values):
        raise InvalidRequestError("logit_bias ids and values differ in length", param="logit_bias")
    return dict(zip(ids, values, strict=True)) or None

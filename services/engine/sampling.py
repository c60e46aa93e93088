"""A sequence's sampling options: its parameters and the state it owns (generator, token history, grammar,
log-probability sink), as the model runner's sampler takes them each step."""

from __future__ import annotations

from gpu.runner import SamplingOptions
from services.engine.sequence import Sequence
from shared.errors import InvalidRequestError


def sampling_options(seq: Sequence) -> SamplingOptions:
    """The sampler's view of a request: its parameters and the state it owns (generator, history, grammar,
    log-probability sink)."""
    s = seq.sampling
    if seq.grammar is not None:
        seq.grammar.catch_up(seq.output_token_ids)  # a DE's first token was sampled by its PE
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
        output_token_ids=seq.output_token_ids,
        grammar=seq.grammar,
        logprobs_out=seq.sampled_logprobs if s.logprobs >= 0 else None,
    )


def _logit_bias(ids: list[int], values: list[float]) -> dict[int, float] | None:
    if len(ids) != len(values):
        raise InvalidRequestError("logit_bias ids and values differ in length", param="logit_bias")
    return dict(zip(ids, values, strict=True)) or None

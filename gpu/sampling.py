"""Token sampling for a batch: logit bias, bans, repetition / presence / frequency penalties, grammar masks,
greedy or temperature with top-k / top-p / min-p, and log-probabilities; reproducible per request seed.

Every step is batched: each feature runs once over the rows that use it, with per-row parameters as tensors
(a row that uses nothing extra costs nothing extra). Each seeded request owns a `random.Random(seed)`
(`SamplingOptions.generator`, kept by whoever owns the request: the engine's `Sequence`) that yields one
uniform number per sampled token; the draw itself (inverse CDF over the truncated sorted distribution) is
batched in torch, so a request's tokens depend only on its seed and its logits, not on what else shares the
batch. The sampler keeps no per-request state: histories, grammar states and the log-probability sink
belong to the request. Options are validated before they get here (`check`): nothing in a step raises for
one row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shared.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures below this are greedy
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


@dataclass(slots=True)
class SamplingOptions:
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (CTRL's rule)
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: dict[int, float] | None = None  # added to the logits (OpenAI: -100..100)
    num_logprobs: int = -1  # -1: none; k >= 0: the sampled token's log-probability and the top k
    # the request's own uniform source, one draw per sampled token (same seed => same tokens); None: the
    # sampler's shared unseeded one
    generator: random.Random | None = None
    # owned by the request: what the penalties count, the grammar state, where log-probabilities go
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    grammar: Any = None  # gpu.grammar.GrammarState
    logprobs_out: list[Any] | None = None  # one (logprob, top ids, top logprobs) appended per token

    @classmethod
    def seeded(cls, seed: int | None, *, temperature: float = 1.0, top_p: float = 1.0) -> SamplingOptions:
        """Options with a fresh generator for `seed` (None: unseeded). Reuse the object for every token of
        one request; a new request needs new options."""
        generator = random.Random(seed) if seed is not None else None
        return cls(temperature=temperature, top_p=top_p, generator=generator)

    def check(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad option (call before the request joins a batch)."""
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature={self.temperature} must be >= 0", param="temperature")
        if not 0 <= self.top_p <= 1:  # 0: only the most likely token
            raise InvalidRequestError(f"top_p={self.top_p} must be in [0, 1]", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k={self.top_k} must be >= 0 (0: no limit)", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p={self.min_p} must be in [0, 1]", param="min_p")
        if not 0 < self.repetition_penalty <= 10:
            raise InvalidRequestError(
                f"repetition_penalty={self.repetition_penalty} must be in (0, 10]", param="repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name}={getattr(self, name)} must be in [-2, 2]", param=name)
        if not -1 <= self.num_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        for token, bias in (self.logit_bias or {}).items():
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token {token} is not in the vocabulary", param="logit_bias"
                )
            if not -100 <= bias <= 100:
                raise InvalidRequestError(f"logit_bias {bias} must be in [-100, 100]", param="logit_bias")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)


@dataclass(slots=True)
class SampleRequest:
    seq_id: str
    options: SamplingOptions
    banned_token_ids: Sequence[int] = field(default_factory=list)


class Sampler:
    def __init__(self) -> None:
        self._unseeded = random.Random()

    def _uniform(self, request: SampleRequest) -> float:
        generator = request.options.generator
        return (generator or self._unseeded).random()

    def sample(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> list[int]:
        """One token per row of `logits` [B, vocab] (fp32, modified in place)."""
        options = [r.options for r in requests]
        wants_logprobs = _rows(options, lambda o: o.num_logprobs >= 0)
        raw = logits.index_select(0, _index(wants_logprobs, logits)) if wants_logprobs else None
        _bias(logits, options)
        _ban(logits, requests)
        _penalize(logits, options)
        constrained = _rows(options, lambda o: o.grammar is not None)
        if constrained:
            _mask_grammar(logits, [options[i].grammar for i in constrained], constrained)
        tokens = logits.argmax(dim=-1)
        sampled = _rows(options, lambda o: not o.is_greedy)
        if sampled:
            rows = _index(sampled, logits)
            tokens[rows] = self._draw(logits.index_select(0, rows), [requests[i] for i in sampled])
        out = [int(t) for t in tokens.tolist()]
        if raw is not None:
            _logprobs(raw, [options[i] for i in wants_logprobs], [out[i] for i in wants_logprobs])
        for i in constrained:
            options[i].grammar.consume(out[i])
        return out

    def _draw(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        device = logits.device
        options = [r.options for r in requests]
        temperature = torch.tensor([o.temperature for o in options], device=device)
        probs = (logits / temperature[:, None]).softmax(dim=-1)
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        top_p = torch.tensor([o.top_p for o in options], device=device)
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]  # smallest prefix reaching top_p
        if any(o.top_k for o in options):
            vocab = logits.shape[1]
            top_k = torch.tensor([o.top_k or vocab for o in options], device=device)
            keep &= torch.arange(vocab, device=device)[None, :] < top_k[:, None]
        if any(o.min_p for o in options):
            min_p = torch.tensor([o.min_p for o in options], device=device)
            keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
        keep[:, 0] = True
        cdf = (sorted_probs * keep).cumsum(dim=-1)
        uniform = torch.tensor([self._uniform(r) for r in requests], device=device, dtype=cdf.dtype)
        choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
        return sorted_ids.gather(1, choice.clamp_(max=cdf.shape[1] - 1))[:, 0]


def _rows(options: Sequence[SamplingOptions], wants: Any) -> list[int]:
    return [i for i, o in enumerate(options) if wants(o)]


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(rows, device=like.device)


def _bias(logits: torch.Tensor, options: Sequence[SamplingOptions]) -> None:
    rows = _rows(options, lambda o: bool(o.logit_bias))
    if not rows:
        return
    row_ids = [i for i in rows for _ in options[i].logit_bias or ()]
    cols = [t for i in rows for t in options[i].logit_bias or ()]
    values = [b for i in rows for b in (options[i].logit_bias or {}).values()]
    index = (torch.tensor(row_ids, device=logits.device), torch.tensor(cols, device=logits.device))
    logits.index_put_(index, torch.tensor(values, device=logits.device, dtype=logits.dtype), accumulate=True)


def _ban(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    rows = [i for i, r in enumerate(requests) if r.banned_token_ids]
    if not rows:
        return
    vocab = logits.shape[1]
    pairs = [(i, c) for i in rows for c in requests[i].banned_token_ids if 0 <= c < vocab]
    if pairs:
        index = torch.tensor(pairs, device=logits.device).T
        logits[index[0], index[1]] = float("-inf")


def _token_counts(histories: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(histories), vocab] occurrence counts (one scatter for all rows)."""
    lengths = [len(h) for h in histories]
    counts = torch.zeros(len(histories), vocab, device=device)
    if sum(lengths):
        ids = torch.from_numpy(np.concatenate([np.asarray(h, dtype=np.int64) for h in histories]))
        rows = torch.repeat_interleave(torch.arange(len(histories)), torch.tensor(lengths))
        counts.index_put_(
            (rows.to(device), ids.to(device)), torch.ones(len(ids), device=device), accumulate=True
        )
    return counts


def _penalize(logits: torch.Tensor, options: Sequence[SamplingOptions]) -> None:
    rows = _rows(options, lambda o: o.has_penalties)
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    chosen = [options[i] for i in rows]
    index = _index(rows, logits)
    sub = logits.index_select(0, index)
    output = _token_counts([o.output_token_ids for o in chosen], vocab, device)
    if any(o.repetition_penalty != 1.0 for o in chosen):
        seen = (_token_counts([o.prompt_token_ids for o in chosen], vocab, device) + output) > 0
        penalty = torch.tensor([o.repetition_penalty for o in chosen], device=device)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    frequency = torch.tensor([o.frequency_penalty for o in chosen], device=device)[:, None]
    presence = torch.tensor([o.presence_penalty for o in chosen], device=device)[:, None]
    sub = sub - frequency * output - presence * (output > 0)
    logits.index_copy_(0, index, sub)


def _mask_grammar(logits: torch.Tensor, states: list[Any], rows: list[int]) -> None:
    """-inf for every token the row's grammar does not allow next."""
    vocab = logits.shape[1]
    words = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for i, state in enumerate(states):
        state.fill_mask(words[i])
    allowed = ((words[:, :, None] & _BITS) != 0).flatten(1)[:, :vocab].to(logits.device)
    index = _index(rows, logits)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def _logprobs(raw: torch.Tensor, options: list[SamplingOptions], tokens: list[int]) -> None:
    """Log-probabilities of the model's own distribution (before bias, penalties, masks and temperature,
    as vLLM reports them): the sampled token's and the top k, into each request's sink."""
    logp = raw.log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=raw.device)[:, None])[:, 0].tolist()
    k = max(o.num_logprobs for o in options)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    for i, o in enumerate(options):
        if o.logprobs_out is not None:
            n = o.num_logprobs
            o.logprobs_out.append((chosen[i], top_id_rows[i][:n], top_lp_rows[i][:n]))

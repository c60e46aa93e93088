"""Token sampling for a batch: greedy, temperature, top-p, banned tokens; reproducible per request seed.

Each seeded request owns a `random.Random(seed)` (`SamplingOptions.generator`, kept by whoever owns the
request: the engine's `Sequence`) that yields one uniform number per sampled token; the draw itself (inverse
CDF over the top-p-truncated sorted distribution) is batched in torch. So a request's tokens depend only on
its seed and its logits, not on what else shares the batch. The sampler keeps no per-request state.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures below this are greedy


@dataclass(slots=True)
class SamplingOptions:
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    # the request's own uniform source, one draw per sampled token (same seed => same tokens); None: the
    # sampler's shared unseeded one
    generator: random.Random | None = None

    @classmethod
    def seeded(cls, seed: int | None, *, temperature: float = 1.0, top_p: float = 1.0) -> SamplingOptions:
        """Options with a fresh generator for `seed` (None: unseeded). Reuse the object for every token of
        one request; a new request needs new options."""
        generator = random.Random(seed) if seed is not None else None
        return cls(temperature=temperature, top_p=top_p, generator=generator)

    def check(self) -> None:
        if not self.temperature >= 0:
            raise InvalidRequestError(f"temperature={self.temperature} must be >= 0", param="temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p={self.top_p} must be in (0, 1]", param="top_p")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
        """One token per row of `logits` [B, vocab] (fp32, modified in place by bans)."""
        _ban(logits, requests)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(requests) if not r.options.is_greedy]
        if sampled:
            rows = torch.as_tensor(sampled, device=logits.device)
            tokens[rows] = self._draw(logits.index_select(0, rows), [requests[i] for i in sampled])
        return [int(t) for t in tokens.tolist()]

    def _draw(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([r.options.temperature for r in requests], device=device)
        top_p = torch.tensor([r.options.top_p for r in requests], device=device)
        probs = (logits / temperature[:, None]).softmax(dim=-1)
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]  # smallest prefix reaching top_p
        keep[:, 0] = True
        cdf = (sorted_probs * keep).cumsum(dim=-1)
        uniform = torch.tensor([self._uniform(r) for r in requests], device=device, dtype=cdf.dtype)
        choice = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)
        return sorted_ids.gather(1, choice.clamp_(max=cdf.shape[1] - 1))[:, 0]


def _ban(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    for i, request in enumerate(requests):
        rows.extend([i] * len(request.banned_token_ids))
        cols.extend(request.banned_token_ids)
    if rows:
        vocab = logits.shape[1]
        valid = [(r, c) for r, c in zip(rows, cols, strict=True) if 0 <= c < vocab]
        if valid:
            index = torch.tensor(valid, device=logits.device).T
            logits[index[0], index[1]] = float("-inf")

"""An LV-Eval-like trace: long-context QA, every prompt over 15K tokens, shared documents.

LV-Eval (paper 7): inputs all exceed 15K tokens; some contexts serve many questions, others one (its mixup
sets build a context per question). The paper reports a 30% cache hit ratio in the cache-populate run, so a
`repeat_share` of the requests ask about a document an earlier request already brought (I); they come in a
random order (I), so a repeat usually finds its document stored. A prompt is its document followed by its
question; answers are short (I: Table 5 by Little's law gives ~13 output tokens with ~40-48 clients).
Loadgen's synthesizers (`loadgen/synth.py`) shape agentic multi-turn traces, not this, hence a generator here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LvShape:
    num_requests: int = 400  # (I) the working set (~1.7 TB of KV) fits the 2 TB pool, as the hit run needs
    repeat_share: float = 0.3  # (P) 30% cache hits in the populate run (7.1)
    questions_per_shared_doc: int = 5  # (I)
    min_prompt_tokens: int = 15_360  # (P) "all input sequences exceeding 15K tokens"
    max_prompt_tokens: int = 24_576  # (I) LV-Eval's 16K level; H20 prefill then fits Table 5
    min_question_tokens: int = 32  # (I)
    max_question_tokens: int = 256  # (I)
    min_output_tokens: int = 6  # (I) mean 13
    max_output_tokens: int = 20  # (I)

    def validate(self) -> None:
        if self.num_requests < 1 or not 0 <= self.repeat_share < 1 or self.questions_per_shared_doc < 2:
            raise ConfigError(
                f"LV-Eval shape: requests {self.num_requests} must be >= 1, repeat share {self.repeat_share} "
                f"in [0, 1), questions per shared doc {self.questions_per_shared_doc} >= 2"
            )
        if not self.min_question_tokens + 16 <= self.min_prompt_tokens <= self.max_prompt_tokens:
            raise ConfigError(
                f"LV-Eval shape: need question + 16 <= min prompt {self.min_prompt_tokens} <= max prompt "
                f"{self.max_prompt_tokens}"
            )
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            outputs = f"{self.min_output_tokens}..{self.max_output_tokens}"
            raise ConfigError(f"LV-Eval shape: output tokens {outputs}: need 1 <= min <= max")


@dataclass(frozen=True, slots=True)
class LvRequest:
    """One question: `doc_tokens` of a document every question about it shares, then its own tokens."""

    request_id: int
    doc_id: int
    doc_tokens: int
    prompt_tokens: int
    output_tokens: int


def _doc_questions(shape: LvShape) -> list[int]:
    """Questions per document: shared documents take `questions_per_shared_doc` each, the rest one."""
    k = shape.questions_per_shared_doc
    num_shared = min(round(shape.repeat_share * shape.num_requests) // (k - 1), shape.num_requests // k)
    singles = shape.num_requests - num_shared * k
    return [k] * num_shared + [1] * singles


def build_lv_trace(shape: LvShape, seed: int) -> tuple[LvRequest, ...]:
    """The requests in the order the closed-loop clients take them (the same order in both runs)."""
    shape.validate()
    rng = np.random.default_rng(seed)
    counts = _doc_questions(shape)
    doc_max = shape.max_prompt_tokens - shape.max_question_tokens
    doc_min = min(doc_max, shape.min_prompt_tokens - shape.min_question_tokens)
    doc_tokens = rng.integers(doc_min, doc_max + 1, size=len(counts))
    doc_ids = np.repeat(np.arange(len(counts)), counts)
    order = rng.permutation(doc_ids.size)
    questions = rng.integers(shape.min_question_tokens, shape.max_question_tokens + 1, size=doc_ids.size)
    outputs = rng.integers(shape.min_output_tokens, shape.max_output_tokens + 1, size=doc_ids.size)
    requests = []
    for i, pos in enumerate(order):
        doc = int(doc_ids[pos])
        prompt = max(shape.min_prompt_tokens, int(doc_tokens[doc] + questions[i]))
        requests.append(LvRequest(i, doc, int(doc_tokens[doc]), prompt, int(outputs[i])))
    return tuple(requests)

"""transformers as the reference model: SmolLM2 loaded from the same GGUF file by transformers' own loader."""

from __future__ import annotations

import functools
from typing import Any

from gpu.model_spec import resolve_model
from gpu.reference import GGUFReaders, load_tokenizer, load_transformers


class SmolLM2Reference:
    """Greedy tokens and log-probabilities of transformers' SmolLM2, loaded on first use (by the loader of
    `kvpath bench model`, which parses the GGUF file once for the model and the tokenizer together)."""

    def __init__(self) -> None:
        self._gguf_readers: GGUFReaders = {}

    @functools.cached_property
    def model(self) -> Any:
        return load_transformers(resolve_model("smollm2"), readers=self._gguf_readers)

    @functools.cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(resolve_model("smollm2"), readers=self._gguf_readers)

    @functools.lru_cache(maxsize=32)  # noqa: B019 (one instance per session)
    def greedy(self, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        """Greedy continuation of exactly max_new_tokens tokens (an EOS does not stop it: ignore_eos)."""
        import torch

        tokens: list[int] = []
        with torch.inference_mode():
            out = self.model(torch.tensor([list(prompt)]), use_cache=True)
            for _ in range(max_new_tokens):
                tokens.append(int(out.logits[0, -1].argmax()))
                if len(tokens) == max_new_tokens:
                    break
                step = torch.tensor([[tokens[-1]]])
                out = self.model(step, cache=out.cache, use_cache=True)
        return tokens

    def logprobs(self, ids: list[int], start: int) -> Any:
        """log-softmax [len(ids) - start, vocab] of the positions predicting ids[start:] (fp32)."""
        import torch

        with torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1].float()
        return logits.log_softmax(dim=-1)

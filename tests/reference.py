"""transformers as the reference model: SmolLM2 loaded from the same GGUF file by transformers' own loader."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any
from unittest import mock


class SmolLM2Reference:
    """Greedy tokens and log-probabilities of transformers' SmolLM2, loaded on first use."""

    def __init__(self) -> None:
        self._gguf_readers: dict[tuple[str, str], Any] = {}  # (path, mode) -> gguf.GGUFReader

    @contextlib.contextmanager
    def _gguf_parsed_once(self) -> Iterator[None]:
        """transformers' GGUF loader parses the file's metadata at each step (config, weights, tokenizer:
        4 s each for SmolLM2's 49k-token vocabulary) and rebuilds gguf's tensor-name map for each of the
        model's 400 modules (5 s); both are pure functions of their arguments, so while transformers loads
        the file each is computed once (15 s -> 8.5 s). What transformers loads, and how, is unchanged."""
        import gguf

        read, name_map = gguf.GGUFReader, functools.cache(gguf.get_tensor_name_map)

        def reader(path: str, mode: str = "r") -> Any:
            key = (str(path), mode)
            if key not in self._gguf_readers:
                self._gguf_readers[key] = read(path, mode)
            return self._gguf_readers[key]

        with (
            mock.patch.object(gguf, "GGUFReader", reader),
            mock.patch.object(gguf, "get_tensor_name_map", name_map),
        ):
            yield

    @functools.cached_property
    def model(self) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        from gpu.model_spec import resolve_model

        path = resolve_model("smollm2")
        with warnings.catch_warnings(), self._gguf_parsed_once():
            warnings.simplefilter("ignore")  # progress bars and deprecation notes of the GGUF loader
            model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
        return model.eval()

    @functools.cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        from gpu.model_spec import resolve_model

        path = resolve_model("smollm2")
        with warnings.catch_warnings(), self._gguf_parsed_once():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

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

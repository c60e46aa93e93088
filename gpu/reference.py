"""transformers as the reference implementation of a served model: the same checkpoint (an HF folder, or a
GGUF file through transformers' own GGUF loader), for `kvpath bench model`'s side-by-side timings and
`kvpath bench agent --reference`'s log-probabilities."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gpu.gguf_file import is_gguf
from gpu.kv_cache import TORCH_DTYPES
from gpu.model_spec import resolve_model

GGUFReaders = dict[tuple[str, str], Any]  # (path, mode) -> gguf.GGUFReader


@contextlib.contextmanager
def gguf_parsed_once(readers: GGUFReaders | None = None) -> Iterator[None]:
    """While it is open, transformers' GGUF loader parses each file once (once across calls that pass the
    same `readers`). It parses the file's metadata at each step (config, weights, tokenizer: 4 s each for
    SmolLM2's 49k-token vocabulary) and rebuilds gguf's tensor-name map for each of the model's 400 modules
    (5 s); both are pure functions of their arguments (15 s -> 8.5 s for SmolLM2). What transformers loads,
    and how, is unchanged."""
    import gguf

    originals: dict[str, Any] = {
        "GGUFReader": gguf.GGUFReader,
        "get_tensor_name_map": gguf.get_tensor_name_map,
    }
    parsed = {} if readers is None else readers

    def reader(path: str, mode: Any = "r") -> Any:
        key = (str(path), mode)
        if key not in parsed:
            parsed[key] = originals["GGUFReader"](path, mode)
        return parsed[key]

    setattr(gguf, "GGUFReader", reader)  # noqa: B010 (swapped for the duration, then restored)
    setattr(gguf, "get_tensor_name_map", functools.cache(originals["get_tensor_name_map"]))  # noqa: B010
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(gguf, name, original)


def _pretrained_args(path: Path) -> tuple[Path, dict[str, Any]]:
    return (path.parent, {"gguf_file": path.name}) if is_gguf(path) else (path, {})


def load_transformers(
    model_path: str | Path, dtype: str = "float32", readers: GGUFReaders | None = None
) -> Any:
    """transformers' causal LM of `model_path` (an HF folder or a .gguf file) in `dtype`, in eval mode on
    the CPU; `readers` as gguf_parsed_once's."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    where, extra = _pretrained_args(Path(model_path))
    with warnings.catch_warnings(), gguf_parsed_once(readers):
        warnings.simplefilter("ignore")  # deprecation notes of the GGUF loader
        model = AutoModelForCausalLM.from_pretrained(where, dtype=TORCH_DTYPES[dtype], **extra)
    return model.eval()


def load_tokenizer(model_path: str | Path, readers: GGUFReaders | None = None) -> Any:
    """transformers' tokenizer of `model_path` (an HF folder or a .gguf file)."""
    from transformers import AutoTokenizer

    where, extra = _pretrained_args(Path(model_path))
    with warnings.catch_warnings(), gguf_parsed_once(readers):
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(where, **extra)


def reference_logprobs(model: str, ids: list[int], start: int) -> Any:
    """log-softmax [len(ids) - start, vocab] of the positions predicting ids[start:] (a torch tensor)."""
    reference = load_transformers(resolve_model(model))
    with torch.inference_mode():
        logits = reference(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1].float()
    return logits.log_softmax(dim=-1)

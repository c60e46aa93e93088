"""transformers as the reference of a GGUF model's log-probabilities (`kvpath bench agent --reference`):
the model loaded from the same file by transformers' own GGUF loader, in fp32 on the CPU."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gpu.model_spec import resolve_model


def reference_logprobs(model: str, ids: list[int], start: int) -> Any:
    """log-softmax [len(ids) - start, vocab] of the positions predicting ids[start:] (a torch tensor)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # progress bars and deprecation notes of the GGUF loader
        reference = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    with torch.inference_mode():
        logits = reference.eval()(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1].float()
    return logits.log_softmax(dim=-1)

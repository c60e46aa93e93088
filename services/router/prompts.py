"""Tokenize a request's prompt and check it against the model's context (pure apart from the tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.router.requests import GenerationRequest
from shared.errors import ContextLengthExceededError, InvalidRequestError


@dataclass(slots=True)
class PreparedPrompt:
    request: GenerationRequest
    token_ids: list[int]
    max_tokens: int
    tokenizer: Any  # gpu.tokenizer.Tokenizer


def prepare_prompt(
    req: GenerationRequest, tokenizer: Any, *, max_model_len: int, vocab_size: int, max_tokens_limit: int
) -> PreparedPrompt:
    if req.endpoint == "chat":
        assert req.messages is not None
        token_ids = list(tokenizer.apply_chat_template(req.messages, add_generation_prompt=True))
    elif req.prompt_token_ids is not None:
        token_ids = req.prompt_token_ids
        if any(t >= vocab_size for t in token_ids):
            raise InvalidRequestError(
                f"'prompt' contains token ids outside the vocabulary (size {vocab_size})", param="prompt"
            )
    else:
        assert req.prompt_text is not None
        token_ids = tokenizer.encode(req.prompt_text)
    if not token_ids:
        raise InvalidRequestError(
            "the prompt is empty", param="prompt" if req.endpoint != "chat" else "messages"
        )
    n = len(token_ids)
    if n >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {n} "
            f"tokens. Please reduce the length of the prompt.",
            param="messages" if req.endpoint == "chat" else "prompt",
        )
    if req.max_tokens is not None and req.max_tokens > max_tokens_limit:
        raise InvalidRequestError(
            f"'max_tokens' must be <= {max_tokens_limit}, got {req.max_tokens}", param="max_tokens"
        )
    max_tokens = req.max_tokens if req.max_tokens is not None else min(max_tokens_limit, max_model_len - n)
    if n + max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion). Please reduce the "
            f"length of the prompt or the completion.",
            param="max_tokens",
        )
    if req.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"'min_tokens' ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens"
        )
    return PreparedPrompt(request=req, token_ids=token_ids, max_tokens=max_tokens, tokenizer=tokenizer)

"""Tokenize a request's prompt and check it against the model's context (pure apart from the tokenizer;
`off_loop_if_large` runs it in a worker thread for a large request)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from gpu.grammar import json_object_grammar, json_schema_grammar
from services.router.requests import GenerationRequest
from services.router.tools import template_messages, tool_grammar
from shared.errors import ContextLengthExceededError, InvalidRequestError
from shared.protocol import SamplingParams

T = TypeVar("T")


@dataclass(slots=True)
class PreparedPrompt:
    request: GenerationRequest
    token_ids: list[int]
    max_tokens: int
    tokenizer: Any  # gpu.tokenizer.Tokenizer
    grammar: str = ""  # llguidance grammar the output must match (response_format, tool calls)
    parses_tool_calls: bool = False  # the output may hold tool calls (tools given, tool_choice not none)


OFF_LOOP_BODY_BYTES = 16 << 10  # requests with bodies at least this long are prepared in a worker thread


async def off_loop_if_large(pool: Executor, body_bytes: int, prepare: Callable[[], T]) -> T:
    """`prepare()` (tokenizing a prompt), in `pool` for a large body: the tokenizer releases the GIL for
    long texts (~0.5 s per MB of prompt here), so the streams the event loop serves meanwhile do not stall."""
    if body_bytes < OFF_LOOP_BODY_BYTES:
        return prepare()
    return await asyncio.get_running_loop().run_in_executor(pool, prepare)


def _prompt_ids(req: GenerationRequest, tokenizer: Any, max_model_len: int, vocab_size: int) -> list[int]:
    if req.endpoint == "chat":
        assert req.messages is not None
        messages, tools = template_messages(req.messages, req.tools, tokenizer.template_renders_tools)
        text = tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
        _check_text_length(text, tokenizer, max_model_len, "messages")
        return tokenizer.encode_rendered(text)  # type: ignore[no-any-return]
    if req.prompt_token_ids is not None:
        if any(t >= vocab_size for t in req.prompt_token_ids):
            raise InvalidRequestError(
                f"'prompt' contains token ids outside the vocabulary (size {vocab_size})", param="prompt"
            )
        return req.prompt_token_ids
    assert req.prompt_text is not None
    _check_text_length(req.prompt_text, tokenizer, max_model_len, "prompt")
    return tokenizer.encode(req.prompt_text)  # type: ignore[no-any-return]


def _check_text_length(text: str, tokenizer: Any, max_model_len: int, param: str) -> None:
    """Refuse a text too long for the context without encoding it: a token is at most `max_token_bytes`
    bytes, a character at least one (a 20 MB prompt took the router 9.6 s of CPU to count)."""
    at_least = -(-len(text) // tokenizer.max_token_bytes)
    if at_least >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has at "
            f"least {at_least} tokens ({len(text)} characters). Please reduce the length of the prompt.",
            param=param,
        )


def _grammar(req: GenerationRequest, grammars: Any) -> str:
    """The request's grammar, validated against the tokenizer (a bad schema is this request's 400)."""
    if req.tools is not None and req.tools.can_call:
        grammar = tool_grammar(req.tools) or ""
        param = "tools"
    elif req.response_format is not None:
        param = "response_format"
        if req.response_format["type"] == "json_object":
            grammar = json_object_grammar()
        else:
            grammar = json_schema_grammar(req.response_format["json_schema"].get("schema", {}), param)
    else:
        return ""
    if grammars is not None and grammar:
        grammars.validate(grammar, param)
    return grammar


def prepare_prompt(
    req: GenerationRequest,
    tokenizer: Any,
    *,
    max_model_len: int,
    vocab_size: int,
    max_tokens_limit: int,
    grammars: Any = None,
) -> PreparedPrompt:
    """`grammars`: the router's gpu.grammar.GrammarCompiler (None: grammars are not validated here)."""
    token_ids = _prompt_ids(req, tokenizer, max_model_len, vocab_size)
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
    if any(t >= vocab_size for t in req.logit_bias):
        raise InvalidRequestError(
            f"'logit_bias' names token ids outside the vocabulary (size {vocab_size})", param="logit_bias"
        )
    return PreparedPrompt(
        request=req,
        token_ids=token_ids,
        max_tokens=max_tokens,
        tokenizer=tokenizer,
        grammar=_grammar(req, grammars),
        parses_tool_calls=req.tools is not None and req.tools.can_call,
    )


def sampling_params(prompt: PreparedPrompt, choice: int = 0, num_choices: int = 1) -> SamplingParams:
    """What the engines sample with; choice i of n gets the seed plus i (distinct and reproducible), here
    or, for `num_choices` sampled by one task, in the engine (`SamplingParams.choice`)."""
    req = prompt.request
    return SamplingParams(
        max_tokens=prompt.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=None if req.seed is None else req.seed + choice,
        ignore_eos=req.ignore_eos,
        min_tokens=min(req.min_tokens, prompt.max_tokens),
        stop_token_ids=req.stop_token_ids,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias_ids=list(req.logit_bias),
        logit_bias_values=list(req.logit_bias.values()),
        logprobs=req.logprobs,
        grammar=prompt.grammar,
        n=num_choices,
    )

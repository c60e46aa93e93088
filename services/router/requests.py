"""OpenAI request bodies -> validated `GenerationRequest`s (pure: no I/O, no tokenizer state).

Every rejection is an `InvalidRequestError` naming the offending parameter, so the API answers 400 with
OpenAI's error body. Tokenization and context-length checks happen in `prompts.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidRequestError

MAX_STOP_SEQUENCES = 4
_SESSION_HEADER = "X-Session-Id"

# Parameters OpenAI defines that kvpath does not implement: accepted only at their neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


@dataclass(slots=True)
class GenerationRequest:
    """One validated generation request, independent of the endpoint it came from."""

    endpoint: str  # "completions" | "chat"
    model: str
    prompt_text: str | None = None  # completions with a text prompt
    prompt_token_ids: list[int] | None = None  # completions with a token-id prompt
    messages: list[dict[str, Any]] | None = None  # chat
    max_tokens: int | None = None  # None: until the context is full (chat default)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # extension: prompt and output token ids in the response
    session_id: str = ""


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number, got {value!r}", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {value!r}", name)
    if lo is not None and value < lo:
        raise _bad(f"'{name}' must be >= {lo}, got {value}", name)
    return value


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _bad(f"'{name}' must be a list of integers", name)
    if any(t < 0 for t in value):
        raise _bad(f"'{name}' must not contain negative token ids", name)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(value) > MAX_STOP_SEQUENCES:
        raise _bad(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}", "stop")
    if any(s == "" for s in value):
        raise _bad("'stop' sequences must not be empty", "stop")
    return value


def _common(body: dict[str, Any], endpoint: str, session_id: str) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    n = _int(body, "n", 1)
    if n != 1:
        raise _bad(f"only n=1 is supported, got n={n}", "n")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise _bad(f"'{name}' is not supported by this server", name)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    stream = _bool(body, "stream")
    if options and not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    max_tokens = _int(body, "max_tokens", None, lo=1)
    if endpoint == "chat":
        completion_cap = _int(body, "max_completion_tokens", None, lo=1)
        max_tokens = completion_cap if completion_cap is not None else max_tokens
    elif max_tokens is None:
        max_tokens = 16  # OpenAI's completions default
    seed = _int(body, "seed", None)
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_token_ids(body.get("stop_token_ids", []), "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0, lo=0) or 0,
        stream=stream,
        include_usage=bool(options and _bool(options, "include_usage")),
        return_token_ids=_bool(body, "return_token_ids"),
        session_id=session_id or (user or ""),
    )


def parse_completion(body: Any, session_id: str = "") -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", "body")
    req = _common(body, "completions", session_id)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        req.prompt_token_ids = _token_ids(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("only one prompt per request is supported", "prompt")
    else:
        raise _bad("'prompt' must be a string or a list of token ids", "prompt")
    return req


def parse_chat(body: Any, session_id: str = "") -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", "body")
    req = _common(body, "chat", session_id)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    return req


def _message(msg: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise _bad(f"{param} must be an object", param)
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise _bad(
            f"{param}.role must be one of system, developer, user, assistant, tool; got {role!r}",
            f"{param}.role",
        )
    content = msg.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise _bad(f"{param}.content parts must be text parts", f"{param}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise _bad(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def session_header(headers: Any) -> str:
    value = headers.get(_SESSION_HEADER, "")
    if len(value) > 256:
        raise _bad(f"{_SESSION_HEADER} is longer than 256 characters", _SESSION_HEADER)
    return str(value)

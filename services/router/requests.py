"""OpenAI request bodies -> validated `GenerationRequest`s (pure: no I/O, no tokenizer state).

Every rejection is an `InvalidRequestError` naming the offending parameter, so the API answers 400 with
OpenAI's error body. Tokenization and context-length checks happen in `prompts.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.router.tools import ToolSpec, parse_tools, tool_fields
from shared.errors import InvalidRequestError
from shared.protocol.messages import SamplingParams
from shared.protocol.movequery import check_chunk_name

MAX_STOP_SEQUENCES = 4
_SESSION_HEADER = "X-Session-Id"

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024
MAX_SLO_MS = 3_600_000.0  # ttft_slo_ms / itl_slo_ms

# Parameters OpenAI defines that kvpath does not implement: accepted only at their neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
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
    n: int = 1  # choices
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int = -1  # -1: none; k: each token's log-probability and the top k alternatives
    echo: bool = False  # completions: the prompt's text before the completion
    tools: ToolSpec | None = None  # chat: the functions the model may call, and how
    response_format: dict[str, Any] | None = None  # {"type": "json_object" | "json_schema", ...}
    cache_salt: str = ""  # vLLM's extension: requests share cached KV only with the same salt (and tenant)
    tenant: str = ""  # the caller's tenant (services/router/auth.py), set by the API after parsing
    ttft_slo_ms: float | None = None  # extension: this request's SLOs (AMPD routes and orders by them)
    itl_slo_ms: float | None = None
    kv_chunk: str = ""  # extension (move the query): keep the prompt as a held chunk under this name


def _range(name: str) -> tuple[float, float]:
    """The bus schema's range of a sampling parameter (SamplingParams.RANGES): one source for both."""
    lo, hi = SamplingParams.RANGES[name]
    assert lo is not None and hi is not None
    return lo, hi


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
    n = _int(body, "n", 1, lo=1) or 1
    if n > MAX_N:
        raise _bad(f"'n' must be <= {MAX_N}, got {n}", "n")
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise _bad("'best_of' is not supported (only best_of equal to n)", "best_of")
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
        temperature=_number(body, "temperature", 1.0, *_range("temperature")),
        top_p=_number(body, "top_p", 1.0, *_range("top_p")),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_token_ids(body.get("stop_token_ids", []), "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0, lo=0) or 0,
        stream=stream,
        include_usage=bool(options and _bool(options, "include_usage")),
        return_token_ids=_bool(body, "return_token_ids"),
        session_id=session_id or (user or ""),
        n=n,
        top_k=_top_k(body),
        min_p=_number(body, "min_p", 0.0, *_range("min_p")),
        repetition_penalty=_repetition_penalty(body),
        presence_penalty=_number(body, "presence_penalty", 0.0, *_range("presence_penalty")),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, *_range("frequency_penalty")),
        logit_bias=_logit_bias(body),
        response_format=_response_format(body),
        cache_salt=_cache_salt(body),
        ttft_slo_ms=_slo_ms(body, "ttft_slo_ms"),
        itl_slo_ms=_slo_ms(body, "itl_slo_ms"),
        kv_chunk=_kv_chunk(body),
    )


def _kv_chunk(body: dict[str, Any]) -> str:
    value = body.get("kv_chunk")
    if value is None:
        return ""
    try:
        return check_chunk_name(value if isinstance(value, str) else "")
    except ValueError:
        raise _bad(
            "'kv_chunk' must be a string of 1 to 128 letters, digits or . _ : - (the name of a chunk)",
            "kv_chunk",
        ) from None


def _slo_ms(body: dict[str, Any], name: str) -> float | None:
    """A latency SLO in milliseconds: a positive number of at most an hour, or absent."""
    if body.get(name) is None:
        return None
    value = _number(body, name, 0.0, 0.0, MAX_SLO_MS)
    if value <= 0:
        raise _bad(f"'{name}' must be > 0 milliseconds, got {value}", name)
    return value


def _cache_salt(body: dict[str, Any]) -> str:
    value = body.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise _bad(f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    return value


def _top_k(body: dict[str, Any]) -> int:
    top_k = _int(body, "top_k", 0)
    if top_k is not None and top_k < -1:
        raise _bad(f"'top_k' must be -1 (no limit), 0 (no limit) or positive, got {top_k}", "top_k")
    return max(top_k or 0, 0)


def _repetition_penalty(body: dict[str, Any]) -> float:
    value = _number(body, "repetition_penalty", 1.0, *_range("repetition_penalty"))
    if value <= 0:
        raise _bad("'repetition_penalty' must be > 0", "repetition_penalty")
    return value


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 300:
        raise _bad("'logit_bias' must be an object of at most 300 token ids", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise _bad(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}", "logit_bias")
        if token < 0:
            raise _bad(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        out[token] = float(bias)
    return out


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return value
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise _bad("'response_format.json_schema.schema' must be a JSON schema", "response_format")
        return value
    raise _bad("'response_format.type' must be text, json_object or json_schema", "response_format")


def parse_completion(body: Any, session_id: str = "") -> GenerationRequest:
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", "body")
    req = _common(body, "completions", session_id)
    logprobs = _int(body, "logprobs", None, lo=0)
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise _bad(f"'logprobs' must be <= {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    req.logprobs = -1 if logprobs is None else logprobs
    req.echo = _bool(body, "echo")
    if req.echo and req.logprobs >= 0:
        raise _bad("'echo' with 'logprobs' (prompt log-probabilities) is not supported", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        req.prompt_token_ids = _token_ids(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise _bad("only one prompt per request is supported", "prompt")
    elif isinstance(prompt, list) and prompt:
        raise _bad("'prompt' as token ids must be a list of integers (no floats, strings or bools)", "prompt")
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
    wants_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, lo=0)
    if top is not None and (top > MAX_LOGPROBS or not wants_logprobs):
        raise _bad(f"'top_logprobs' must be <= {MAX_LOGPROBS} and needs 'logprobs': true", "top_logprobs")
    req.logprobs = (top or 0) if wants_logprobs else -1
    req.tools = parse_tools(body)
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
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    out.update(tool_fields(msg, role, param))
    return out


def session_header(headers: Any) -> str:
    value = headers.get(_SESSION_HEADER, "")
    if len(value) > 256:
        raise _bad(f"{_SESSION_HEADER} is longer than 256 characters", _SESSION_HEADER)
    return str(value)

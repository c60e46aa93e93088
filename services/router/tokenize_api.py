"""The tokenizer over HTTP, as vLLM serves it: `POST /tokenize`, `POST /detokenize`; and `GET /version`.

`/tokenize` takes `{"model", "prompt"}` (raw text, BOS as the model adds it) or `{"model", "messages"}` (the
chat template applied, `add_generation_prompt` default true) and answers `{"tokens", "count",
"max_model_len"}`; `/detokenize` takes `{"model", "tokens"}` and answers `{"prompt"}`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from services.router.prompts import off_loop_if_large
from shared.errors import InvalidRequestError, KvpathError, ModelNotFoundError
from shared.version import kvpath_version


def add_routes(app: web.Application, context: Callable[[web.Request], Any]) -> None:
    """`context(request)`: the API's context (tokenizer, model name, limits)."""

    async def tokenize(request: web.Request) -> web.Response:
        return await _answer(request, context(request), _tokenize)

    async def detokenize(request: web.Request) -> web.Response:
        return await _answer(request, context(request), _detokenize)

    async def version(request: web.Request) -> web.Response:
        return _json({"version": kvpath_version()})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())


async def _answer(
    request: web.Request, ctx: Any, handle: Callable[[Any, dict[str, Any]], dict[str, Any]]
) -> web.Response:
    try:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequestError(f"request body is not valid JSON: {exc}", param="body") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object", param="body")
        model = body.get("model", ctx.model_name)
        if model != ctx.model_name:
            raise ModelNotFoundError(
                f"The model '{model}' does not exist; this server serves '{ctx.model_name}'", param="model"
            )
        return _json(
            await off_loop_if_large(ctx.prepare_pool, len(raw), functools.partial(handle, ctx, body))
        )
    except KvpathError as exc:
        return _json(exc.to_openai_body(), exc.http_status)


def _tokenize(ctx: Any, body: dict[str, Any]) -> dict[str, Any]:
    if "messages" in body:
        from services.router.requests import parse_chat

        req = parse_chat({**body, "model": ctx.model_name})
        generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(generation_prompt, bool):
            raise InvalidRequestError(
                "'add_generation_prompt' must be a boolean", param="add_generation_prompt"
            )
        assert req.messages is not None
        tokens = ctx.tokenizer.apply_chat_template(req.messages, add_generation_prompt=generation_prompt)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError("'prompt' (a string) or 'messages' is required", param="prompt")
        tokens = ctx.tokenizer.encode(prompt)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len}


def _detokenize(ctx: Any, body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise InvalidRequestError("'tokens' must be a list of token ids", param="tokens")
    if any(not 0 <= t < ctx.vocab_size for t in tokens):
        raise InvalidRequestError(f"'tokens' must be in 0..{ctx.vocab_size - 1}", param="tokens")
    return {"prompt": ctx.tokenizer.decode(tokens)}

"""OpenAI-compatible HTTP API on aiohttp: completions and chat (JSON or SSE), models.

SSE framing is OpenAI's: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end; with
`stream_options.include_usage` a last chunk with empty `choices` carries `usage` (with
`prompt_tokens_details.cached_tokens`). Errors before the first byte are plain HTTP errors in OpenAI's body
format; errors after it are an `error` event followed by `[DONE]`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from services.router import metrics
from services.router.core import Piece, RouterCore, Usage
from services.router.prompts import PreparedPrompt, prepare_prompt
from services.router.requests import GenerationRequest, parse_chat, parse_completion, session_header
from shared.errors import InvalidRequestError, KvpathError, ModelNotFoundError

log = logging.getLogger(__name__)

_NO_FINISH = b',"logprobs":null,"finish_reason":null'
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(slots=True)
class ApiContext:
    core: RouterCore
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    max_tokens_limit: int
    retry_after_s: int
    created: int


API_CONTEXT = web.AppKey("api_context", ApiContext)


def error_response(exc: KvpathError, retry_after_s: int = 1) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)} if exc.http_status in (429, 503) else None
    return web.json_response(
        exc.to_openai_body(),
        status=exc.http_status,
        headers=headers,
        dumps=lambda o: orjson.dumps(o).decode(),
    )


def add_api_routes(app: web.Application, ctx: ApiContext) -> None:
    app[API_CONTEXT] = ctx
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)


async def _models(request: web.Request) -> web.Response:
    ctx = request.app[API_CONTEXT]
    body = {
        "object": "list",
        "data": [
            {
                "id": ctx.model_name,
                "object": "model",
                "created": ctx.created,
                "owned_by": "kvpath",
                "max_model_len": ctx.max_model_len,
            }
        ],
    }
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat)


async def _serve(request: web.Request, parse: Callable[[Any, str], GenerationRequest]) -> web.StreamResponse:
    ctx = request.app[API_CONTEXT]
    try:
        prompt = _prepare(ctx, parse(await _json_body(request), session_header(request.headers)))
    except KvpathError as exc:
        metrics.REQUESTS.labels("?", exc.code).inc()
        return error_response(exc, ctx.retry_after_s)
    endpoint = prompt.request.endpoint
    request_id = ctx.core.new_request_id(endpoint)
    usage = Usage()
    pieces = ctx.core.generate(prompt, request_id, usage)
    renderer = _Renderer(
        endpoint,
        request_id,
        ctx.model_name,
        prompt.request.include_usage,
        prompt.token_ids if prompt.request.return_token_ids else None,
    )
    outcome = "ok"
    try:
        async with contextlib.aclosing(pieces):
            if prompt.request.stream:
                return await _stream(request, pieces, renderer, usage, ctx)
            return await _collect(pieces, renderer, usage)
    except KvpathError as exc:
        outcome = exc.code
        return error_response(exc, ctx.retry_after_s)
    except BaseException:
        outcome = "cancelled"
        raise
    finally:
        metrics.REQUESTS.labels(endpoint, outcome).inc()
        metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
        metrics.CACHED_TOKENS.inc(usage.cached_tokens)


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", param="body") from None


def _prepare(ctx: ApiContext, req: GenerationRequest) -> PreparedPrompt:
    if req.model != ctx.model_name:
        raise ModelNotFoundError(
            f"The model '{req.model}' does not exist; this server serves '{ctx.model_name}'", param="model"
        )
    return prepare_prompt(
        req,
        ctx.tokenizer,
        max_model_len=ctx.max_model_len,
        vocab_size=ctx.vocab_size,
        max_tokens_limit=ctx.max_tokens_limit,
    )


async def _collect(pieces: AsyncIterator[Piece], renderer: _Renderer, usage: Usage) -> web.Response:
    parts: list[str] = []
    token_ids: list[int] = []
    finish: str | None = None
    async for piece in pieces:
        parts.append(piece.text)
        token_ids += piece.token_ids
        finish = piece.finish_reason or finish
    body = renderer.final("".join(parts), finish or "stop", usage, token_ids)
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _stream(
    request: web.Request, pieces: AsyncIterator[Piece], renderer: _Renderer, usage: Usage, ctx: ApiContext
) -> web.StreamResponse:
    # the first piece comes before the headers, so dispatch errors are still plain HTTP errors
    first = await anext(pieces, None)
    response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
    await response.prepare(request)
    write: Callable[[bytes], Awaitable[None]] = response.write
    try:
        if renderer.endpoint == "chat":
            await write(renderer.sse(renderer.chunk("", None, [], role=True)))
        piece = first
        while piece is not None:
            if piece.text or piece.finish_reason is not None or renderer.wants_token_ids(piece.token_ids):
                await write(renderer.chunk_sse(piece.text, piece.finish_reason, piece.token_ids))
            piece = await anext(pieces, None)
        if renderer.include_usage:
            await write(renderer.sse(renderer.usage_chunk(usage)))
    except KvpathError as exc:
        log.warning("stream failed request_id=%s code=%s: %s", renderer.request_id, exc.code, exc.message)
        await write(renderer.sse(exc.to_openai_body()))
    await write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


class _Renderer:
    """Builds OpenAI response objects for one request."""

    __slots__ = (
        "_chunk_head",
        "_chunk_tail",
        "created",
        "endpoint",
        "has_sent_prompt_ids",
        "include_usage",
        "model",
        "prompt_token_ids",
        "request_id",
    )

    def __init__(
        self,
        endpoint: str,
        request_id: str,
        model: str,
        include_usage: bool,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.prompt_token_ids = prompt_token_ids  # set when the client asked for token ids
        self.has_sent_prompt_ids = False
        self.created = int(time.time())
        # constant parts of every middle chunk's SSE bytes (see chunk_sse)
        obj_type = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        envelope = orjson.dumps(self._envelope(obj_type))[:-1]  # without the closing brace
        self._chunk_head = b"data: " + envelope + b',"choices":[{"index":0,'
        self._chunk_tail = b"}]" + (b',"usage":null' if include_usage else b"") + b"}\n\n"

    def wants_token_ids(self, token_ids: list[int]) -> bool:
        return self.prompt_token_ids is not None and bool(token_ids)

    @staticmethod
    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def chunk_sse(self, text: str, finish_reason: str | None, token_ids: list[int]) -> bytes:
        """`sse(chunk(text, finish_reason, token_ids))`; the same bytes, built from the constant parts for a
        middle chunk (no finish reason, prompt ids already sent): the per-token hot path."""
        if finish_reason is not None or (self.prompt_token_ids is not None and not self.has_sent_prompt_ids):
            return self.sse(self.chunk(text, finish_reason, token_ids))
        if self.endpoint == "chat":
            body = b'"delta":{"content":' + orjson.dumps(text) + b"}" if text else b'"delta":{}'
        else:
            body = b'"text":' + orjson.dumps(text)
        ids = b',"token_ids":' + orjson.dumps(token_ids) if self.prompt_token_ids is not None else b""
        return b"".join((self._chunk_head, body, _NO_FINISH, ids, self._chunk_tail))

    def _envelope(self, obj_type: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj_type, "created": self.created, "model": self.model}

    def chunk(
        self, text: str, finish_reason: str | None, token_ids: list[int], *, role: bool = False
    ) -> dict[str, Any]:
        if self.endpoint == "chat":
            out = self._envelope("chat.completion.chunk")
            delta: dict[str, Any] = (
                {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            )
            out["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        else:
            out = self._envelope("text_completion")
            out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        self._add_token_ids(out, token_ids, first=role or self.endpoint != "chat")
        if self.include_usage:
            out["usage"] = None
        return out

    def _add_token_ids(self, out: dict[str, Any], token_ids: list[int], *, first: bool) -> None:
        if self.prompt_token_ids is None:
            return
        out["choices"][0]["token_ids"] = token_ids
        if first and not self.has_sent_prompt_ids:
            out["prompt_token_ids"] = self.prompt_token_ids
            self.has_sent_prompt_ids = True  # once per response

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.endpoint == "chat" else "text_completion")
        out["choices"] = []
        out["usage"] = usage_body(usage)
        return out

    def final(self, text: str, finish_reason: str, usage: Usage, token_ids: list[int]) -> dict[str, Any]:
        if self.endpoint == "chat":
            out = self._envelope("chat.completion")
            out["choices"] = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ]
        else:
            out = self._envelope("text_completion")
            out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        self._add_token_ids(out, token_ids, first=True)
        out["usage"] = usage_body(usage)
        return out


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }

"""OpenAI-compatible HTTP API on aiohttp: completions and chat (JSON or SSE), models, tokenizer endpoints.

SSE framing is OpenAI's: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end; with
`stream_options.include_usage` a last chunk with empty `choices` carries `usage` (with
`prompt_tokens_details.cached_tokens`). Errors before the first byte are plain HTTP errors in OpenAI's body
format; errors after it are an `error` event followed by `[DONE]`. A request with `n` choices is one engine
task that prefills the prompt once and forks it n ways (colocated and DualPath; else n tasks), choice i
seeded `seed + i`, merged into one response (choices.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from services.router import chunks_api, metrics, tokenize_api
from services.router.auth import TENANT
from services.router.choices import merged_pieces
from services.router.core import Piece, RouterCore, Usage
from services.router.prompts import PreparedPrompt, off_loop_if_large, prepare_prompt
from services.router.render import RenderOptions, ResponseRenderer
from services.router.requests import GenerationRequest, parse_chat, parse_completion, session_header
from services.router.write_guard import ClientStalledError, WriteGuard
from shared.errors import (
    InvalidRequestError,
    KvpathError,
    ModelNotFoundError,
    RequestTimeoutError,
    RequestTooLargeError,
    ServiceUnavailableError,
)

log = logging.getLogger(__name__)

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
    stream_write_timeout_s: float = 60.0
    grammars: Any = None  # gpu.grammar.GrammarCompiler of the tokenizer (validates request grammars)
    # large prompts are prepared here, off the event loop (two at a time: the CPU a burst of them takes)
    prepare_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="prepare-prompt")
    )


API_CONTEXT = web.AppKey("api_context", ApiContext)


def shutting_down() -> ServiceUnavailableError:
    """What a stopping router answers new requests, and ends the streams its drain outlasted with."""
    return ServiceUnavailableError("the router is shutting down; retry")


def error_response(exc: KvpathError, retry_after_s: int = 1) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)} if exc.http_status in (429, 503) else None
    return web.json_response(
        exc.to_openai_body(),
        status=exc.http_status,
        headers=headers,
        dumps=lambda o: orjson.dumps(o).decode(),
    )


def body_limit_middleware(limit_bytes: int) -> Any:
    """A body over the app's `client_max_size` is a JSON 413 in OpenAI's shape (aiohttp's is text/plain)."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except web.HTTPRequestEntityTooLarge:
            return error_response(
                RequestTooLargeError(f"The request body is over the server's limit of {limit_bytes} bytes")
            )

    return check


def body_read_middleware(timeout_s: float) -> Any:
    """A request body not received whole within `timeout_s` is a JSON 408 and its connection closed (a
    client that sends headers and then stalls, or trickles its body, held its handler and connection for
    as long as it kept the socket open). Inside the auth middleware: a client without a key is refused
    before its body is read."""

    @web.middleware
    async def read(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()  # kept by the request: the handler's read returns it
            except TimeoutError:
                response = error_response(
                    RequestTimeoutError(f"The request body did not arrive within {timeout_s:g}s")
                )
                response.force_close()
                return response
        return await handler(request)  # type: ignore[no-any-return]

    return read


def add_api_routes(app: web.Application, ctx: ApiContext) -> None:
    app[API_CONTEXT] = ctx
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model_id:.+}", _model)
    tokenize_api.add_routes(app, lambda request: request.app[API_CONTEXT])
    chunks_api.add_routes(app, lambda request: request.app[API_CONTEXT].core)


def _model_card(ctx: ApiContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "kvpath",
        "max_model_len": ctx.max_model_len,
        "vocab_size": ctx.vocab_size,  # extension: clients drawing token-id prompts stay inside it
    }


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())


async def _models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [_model_card(request.app[API_CONTEXT])]})


async def _model(request: web.Request) -> web.Response:
    ctx = request.app[API_CONTEXT]
    model_id = request.match_info["model_id"]
    if model_id != ctx.model_name:
        return error_response(
            ModelNotFoundError(
                f"The model '{model_id}' does not exist; this server serves '{ctx.model_name}'"
            )
        )
    return _json(_model_card(ctx))


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat)


async def _serve(request: web.Request, parse: Callable[[Any, str], GenerationRequest]) -> web.StreamResponse:
    ctx = request.app[API_CONTEXT]
    if ctx.core.draining:  # stopping: another router replica takes it
        refused = error_response(shutting_down(), ctx.retry_after_s)
        refused.force_close()
        return refused
    try:
        raw = await request.read()
        parsed = parse(_json_loads(raw), session_header(request.headers))
        parsed.tenant = request.get(TENANT, "")  # salts its KV chain: tenants never share cached KV
        prompt = await _prepare(ctx, parsed, len(raw))
    except KvpathError as exc:
        metrics.REQUESTS.labels("?", exc.code).inc()
        return error_response(exc, ctx.retry_after_s)
    req = prompt.request
    request_id = ctx.core.new_request_id(req.endpoint)
    usages = [Usage() for _ in range(req.n)]
    generators = ctx.core.generate_choices(prompt, request_id, usages)
    renderer = ResponseRenderer(_render_options(ctx, prompt, request_id))
    outcome = "ok"
    try:
        async with contextlib.AsyncExitStack() as stack:
            for generator in generators:
                await stack.enter_async_context(contextlib.aclosing(generator))
            pieces = merged_pieces(generators)
            await stack.enter_async_context(contextlib.aclosing(pieces))
            if req.stream:
                return await _stream(request, pieces, renderer, usages, ctx)
            return await _collect(pieces, renderer, usages)
    except KvpathError as exc:
        outcome = exc.code
        return error_response(exc, ctx.retry_after_s)
    except ClientStalledError:
        outcome = "client_stalled"
        raise
    except BaseException:
        outcome = "cancelled"
        raise
    finally:
        total = _total(usages)
        metrics.REQUESTS.labels(req.endpoint, outcome).inc()
        metrics.PROMPT_TOKENS.inc(total.prompt_tokens)
        metrics.CACHED_TOKENS.inc(total.cached_tokens)


def _render_options(ctx: ApiContext, prompt: PreparedPrompt, request_id: str) -> RenderOptions:
    req = prompt.request
    echo = ""
    if req.echo:
        echo = req.prompt_text if req.prompt_text is not None else ctx.tokenizer.decode(prompt.token_ids)
    return RenderOptions(
        endpoint=req.endpoint,
        request_id=request_id,
        model=ctx.model_name,
        n=req.n,
        include_usage=req.include_usage,
        prompt_token_ids=prompt.token_ids if req.return_token_ids else None,
        tokenizer=ctx.tokenizer,
        wants_logprobs=req.logprobs >= 0,
        parses_tool_calls=prompt.parses_tool_calls,
        is_tool_forced=req.tools is not None and req.tools.is_forced,
        echo=echo,
    )


def _total(usages: list[Usage]) -> Usage:
    """One prompt, n completions: the prompt counted once (choice 0's), completions summed."""
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=first.cached_tokens,
    )


def _json_loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", param="body") from None


def check_model(ctx: ApiContext, model: str) -> None:
    if model != ctx.model_name:
        raise ModelNotFoundError(
            f"The model '{model}' does not exist; this server serves '{ctx.model_name}'", param="model"
        )


async def _prepare(ctx: ApiContext, req: GenerationRequest, body_bytes: int) -> PreparedPrompt:
    """Tokenize the prompt and check the request against the model; a large body is tokenized by a worker
    thread (the tokenizer releases the GIL for long texts), so the streams the event loop serves do not
    stall behind it: ~0.5 s per MB of prompt on this machine."""
    check_model(ctx, req.model)
    prepare = functools.partial(
        prepare_prompt,
        req,
        ctx.tokenizer,
        max_model_len=ctx.max_model_len,
        vocab_size=ctx.vocab_size,
        max_tokens_limit=ctx.max_tokens_limit,
        grammars=ctx.grammars,
    )
    return await off_loop_if_large(ctx.prepare_pool, body_bytes, prepare)


async def _collect(
    pieces: AsyncIterator[tuple[int, Piece]], renderer: ResponseRenderer, usages: list[Usage]
) -> web.Response:
    async for index, piece in pieces:
        renderer.add_piece(index, piece)
    return web.Response(body=orjson.dumps(renderer.final(_total(usages))), content_type="application/json")


async def _stream(
    request: web.Request,
    pieces: AsyncIterator[tuple[int, Piece]],
    renderer: ResponseRenderer,
    usages: list[Usage],
    ctx: ApiContext,
) -> web.StreamResponse:
    # the first piece comes before the headers, so dispatch errors are still plain HTTP errors
    first = await anext(pieces, None)
    response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
    await response.prepare(request)
    guard = WriteGuard(request, response, ctx.stream_write_timeout_s, renderer.o.request_id)
    try:
        await _write_events(guard.write, first, pieces, renderer, usages)
        await guard.write_eof()
    finally:
        guard.close()
    return response


async def _write_events(
    write: Callable[[bytes], Awaitable[None]],
    first: tuple[int, Piece] | None,
    pieces: AsyncIterator[tuple[int, Piece]],
    renderer: ResponseRenderer,
    usages: list[Usage],
) -> None:
    try:
        for chunk in renderer.first_chunks():
            await write(chunk)
        item = first
        while item is not None:
            for chunk in renderer.piece_chunks(*item):
                await write(chunk)
            item = await anext(pieces, None)
        if renderer.o.include_usage:
            await write(renderer.usage_chunk(_total(usages)))
    except KvpathError as exc:
        log.warning("stream failed request_id=%s code=%s: %s", renderer.o.request_id, exc.code, exc.message)
        await write(renderer.sse(exc.to_openai_body()))
    await write(b"data: [DONE]\n\n")

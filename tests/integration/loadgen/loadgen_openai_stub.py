"""A small OpenAI-compatible server for the load generator's client tests.

It stands for "any OpenAI-compatible server" (the load generator must not depend on kvpath): real HTTP and
SSE over a real socket, a prefix cache over chained block hashes that reports
`usage.prompt_tokens_details.cached_tokens`, vLLM-style `ignore_eos` / `min_tokens` (without them it stops
early, as a model hitting EOS would), optional `return_token_ids`, and a strict mode that rejects unknown
body fields as some servers do. Faults are injected through `fail(body, headers)`.
The kvpath cluster itself is exercised in test_loadgen_kvpath.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

KNOWN_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "user",
        "max_completion_tokens",
    }
)
EARLY_EOS_TOKENS = 3


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@dataclass
class StubServer:
    token_delay_s: float = 0.0
    block_tokens: int = 16
    strict: bool = False
    fail: Callable[[dict[str, Any], Any], tuple[int, str] | None] | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    session_ids: list[str] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0
    _cache: set[tuple[int, ...]] = field(default_factory=set)
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    def _prompt_ids(self, body: dict[str, Any], endpoint: str) -> list[int]:
        if endpoint == "chat":
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
            return list(text.encode())
        prompt = body["prompt"]
        return list(prompt.encode()) if isinstance(prompt, str) else list(prompt)

    def _cached_tokens(self, ids: list[int]) -> int:
        hits = 0
        for end in range(self.block_tokens, len(ids) + 1, self.block_tokens):
            if tuple(ids[:end]) not in self._cache:
                break
            hits = end
        return hits

    def _remember(self, ids: list[int]) -> None:
        for end in range(self.block_tokens, len(ids) + 1, self.block_tokens):
            self._cache.add(tuple(ids[:end]))

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._respond(request, endpoint)
        finally:
            self.inflight -= 1

    async def _respond(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        self.session_ids.append(request.headers.get("X-Session-Id", ""))
        unknown = sorted(set(body) - KNOWN_FIELDS)
        if self.strict and unknown:
            return _error(400, f"unknown fields {unknown}", "unknown_field")
        if self.fail is not None and (fault := self.fail(body, request.headers)) is not None:
            return _error(fault[0], fault[1], "injected")
        prompt = self._prompt_ids(body, endpoint)
        max_tokens = int(body.get("max_tokens") or 16)
        exact = body.get("ignore_eos") or body.get("min_tokens", 0) >= max_tokens
        n_out = max_tokens if exact else min(max_tokens, EARLY_EOS_TOKENS)
        output = [(len(prompt) * 31 + i * 7) % 256 for i in range(n_out)]
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n_out,
            "total_tokens": len(prompt) + n_out,
            "prompt_tokens_details": {"cached_tokens": self._cached_tokens(prompt)},
        }
        self._remember(prompt)
        self._remember(prompt + output)
        if not body.get("stream"):
            text = "".join(chr(97 + t % 26) for t in output)
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            return web.json_response({"object": "text_completion", "choices": [choice], "usage": usage})
        return await self._stream(request, body, endpoint, output, usage)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        endpoint: str,
        output: list[int],
        usage: dict[str, Any],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with_ids = bool(body.get("return_token_ids"))

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

        if endpoint == "chat":
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i, token in enumerate(output):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            text = chr(97 + token % 26)
            finish = "length" if i == len(output) - 1 else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if endpoint == "chat":
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            if with_ids:
                choice["token_ids"] = [token]
            await send({"choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

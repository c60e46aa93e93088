"""The OpenAI-compatible streaming client of the load generator and the benchmarks (aiohttp).

One POST per call to /v1/completions or /v1/chat/completions with `stream: true` and
`stream_options.include_usage` (the final chunk's usage carries prompt_tokens_details.cached_tokens).
Exact lengths: `max_tokens` plus, unless turned off for servers that reject unknown fields, the vLLM-style
`ignore_eos` and `min_tokens`; `want_token_ids` adds `return_token_ids` (kvpath and vLLM list each chunk's
token ids). The agent's session goes in the `X-Session-Id` header. The SSE framing is `loadgen.sse`'s.

A stream chunk is token-bearing when its choice carries text (completions) or delta content (chat) or token
ids, except a chat chunk that only opens the message (role) and an empty chunk that only carries the
finish_reason; an empty string counts (a byte of a multi-byte character). Where the server lists the chunk's
`token_ids`, they decide alone: the chunk carries that many tokens (several when the server coalesced them),
none when the list is empty; otherwise a token-bearing chunk counts as one token. A stream whose only
tokens came in the chunk with the finish_reason, rendered as "" (a partial multi-byte character), gets its
first token stamped there from the usage's completion_tokens. All chunks of one network
read share its arrival time. The first token-bearing chunk stamps TTFT, the second TTST, the gaps between
them are ITL samples; the record also keeps every such chunk's arrival time and token count.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from loadgen.metrics import CallRecord
from loadgen.sessions import CallOutput, CallRequest
from loadgen.sse import SseParser
from shared.errors import ServiceUnavailableError


def base_url(url: str) -> str:
    """`http://host:port` from a URL that may end in `/` or `/v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class OpenAIClient:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        model: str,
        *,
        endpoint: str = "completions",
        exact_lengths: bool = True,
        want_token_ids: bool = False,
        session_header: bool = True,
        temperature: float | None = 0.0,
        extra_body: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.http, self.model, self.endpoint = http, model, endpoint
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self.url = base_url(url) + path
        self.exact_lengths, self.want_token_ids = exact_lengths, want_token_ids
        self.session_header, self.temperature = session_header, temperature
        self.extra_body = extra_body or {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 30.0))
        self.clock = clock
        self.t0 = clock()

    def body(self, req: CallRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, **req.payload, "max_tokens": req.max_tokens}
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.exact_lengths:
            body["ignore_eos"] = True
            body["min_tokens"] = req.max_tokens
        if self.want_token_ids:
            body["return_token_ids"] = True
        body.update(self.extra_body)
        return body

    def now(self) -> float:
        return self.clock() - self.t0

    async def send(
        self, req: CallRequest, t_ready_s: float, sink: list[CallRecord] | None = None
    ) -> tuple[CallRecord, CallOutput]:
        """Send one call; server and network faults land in the record (appended to `sink` up front, so a
        cancelled call is still reported). Only cancellation propagates."""
        record = CallRecord(req.session_id, req.turn, t_ready_s, self.now(), req.max_tokens)
        if sink is not None:
            sink.append(record)
        record.client_prompt_tokens, record.ideal_cached_tokens = req.prompt_tokens, req.ideal_cached_tokens
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.session_header:
            headers["X-Session-Id"] = req.session_id
        data = orjson.dumps(self.body(req), option=orjson.OPT_SERIALIZE_NUMPY)
        output = CallOutput(ok=False)
        try:
            async with self.http.post(self.url, data=data, headers=headers, timeout=self.timeout) as resp:
                record.status = resp.status
                if resp.status >= 400:
                    await _record_http_error(resp, record)
                else:
                    output = await self._read_stream(resp, record)
        except asyncio.CancelledError:
            record.error, record.error_code = "cancelled", "cancelled"
            raise
        except TimeoutError:
            record.error, record.error_code = "request deadline exceeded", "timeout"
        except aiohttp.ClientError as exc:
            record.error, record.error_code = f"{type(exc).__name__}: {exc}", "connection_error"
        except ValueError as exc:  # a chunk that is not JSON, or a line past the parser's limit
            record.error, record.error_code = f"malformed stream: {exc}", "bad_stream"
        finally:
            if record.error is None and record.t_end_s is None:
                record.error, record.error_code = "stream ended without [DONE]", "incomplete_stream"
        return record, output

    async def _read_stream(self, resp: aiohttp.ClientResponse, record: CallRecord) -> CallOutput:
        texts: list[str] = []
        ids: list[int] = []
        usage: dict[str, Any] | None = None
        finished_s: float | None = None  # arrival of the chunk that carried the finish_reason
        parser = SseParser()
        async for data in resp.content.iter_any():
            if record.t_end_s is not None:
                continue  # after [DONE]: read to the end all the same, so the connection can be reused
            arrived_s = self.now()
            for payload in parser.feed(data):
                if payload == b"[DONE]":
                    record.t_end_s = arrived_s
                    break
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    _record_stream_error(record, chunk["error"])
                    return CallOutput(ok=False)
                usage = chunk.get("usage") or usage
                if finished_s is None and any(c.get("finish_reason") for c in chunk.get("choices") or ()):
                    finished_s = arrived_s
                num_tokens, text, chunk_ids = self._token_content(chunk)
                if num_tokens:
                    _stamp_tokens(record, arrived_s, num_tokens)
                    texts.append(text)
                    ids.extend(chunk_ids)
        _apply_usage(record, usage)
        if record.t_first_s is None and record.output_tokens and finished_s is not None:
            # the only tokens came with the finish_reason and render as "" (part of a multi-byte
            # character): the usage says they were there
            _stamp_tokens(record, finished_s, record.output_tokens)
        if record.output_tokens == 0:
            record.output_tokens = sum(record.chunk_tokens)
        return CallOutput(ok=record.t_end_s is not None, text="".join(texts), token_ids=ids or None)

    def _token_content(self, chunk: dict[str, Any]) -> tuple[int, str, list[int]]:
        """(tokens the chunk carries, its text, its ids); see the module docstring."""
        choices = chunk.get("choices") or []
        if not choices:
            return 0, "", []
        choice = choices[0]
        if self.endpoint == "chat":
            delta = choice.get("delta") or {}
            text = delta.get("content")
            empty_ok = "role" not in delta
        else:
            text = choice.get("text")
            empty_ok = True
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            return len(ids), text or "", ids
        if text:
            return 1, text, []
        is_token = text is not None and empty_ok and choice.get("finish_reason") is None
        return int(is_token), "", []


def _stamp_tokens(record: CallRecord, t: float, num_tokens: int) -> None:
    if record.t_first_s is None:
        record.t_first_s = t
    else:
        if record.t_second_s is None:
            record.t_second_s = t
        gap = t - (record.t_last_token_s or t)
        record.itl_s.append(gap)
        record.itl_max_s = max(record.itl_max_s or 0.0, gap)
    record.t_last_token_s = t
    record.token_chunks += 1
    record.chunk_times_s.append(t)
    record.chunk_tokens.append(num_tokens)


def _record_stream_error(record: CallRecord, error: Any) -> None:
    err = error if isinstance(error, dict) else {"message": str(error)}
    record.error = str(err.get("message", "stream error"))
    record.error_code = str(err.get("code") or "stream_error")


def _apply_usage(record: CallRecord, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    record.prompt_tokens = usage.get("prompt_tokens")
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    record.cached_tokens = int(cached) if cached is not None else None


async def _record_http_error(resp: aiohttp.ClientResponse, record: CallRecord) -> None:
    text = await resp.text()
    try:
        err = orjson.loads(text).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        err = {}
    record.error = str(err.get("message") or text[:500] or resp.reason or f"HTTP {resp.status}")
    record.error_code = str(err.get("code") or f"http_{resp.status}")
    record.t_end_s = None


async def first_model(http: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> str:
    """The id of the first model the server lists at GET /v1/models."""
    return str((await model_card(http, url, "", timeout_s=timeout_s))["id"])


async def model_card(
    http: aiohttp.ClientSession, url: str, model: str, *, timeout_s: float = 30.0
) -> dict[str, Any]:
    """The server's entry for `model` at GET /v1/models (the first one when `model` is empty; `{"id": model}`
    when the server does not list it: some servers serve names they do not list)."""
    try:
        async with http.get(
            base_url(url) + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            resp.raise_for_status()
            body = await resp.json(loads=orjson.loads)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        if model:
            return {"id": model}
        raise ServiceUnavailableError(f"cannot list models at {base_url(url)}/v1/models: {exc}") from exc
    cards = [c for c in body.get("data") or [] if isinstance(c, dict) and "id" in c]
    if model:
        return next((c for c in cards if c["id"] == model), {"id": model})
    if not cards:
        raise ServiceUnavailableError(f"{base_url(url)}/v1/models lists no model; pass --model")
    return cards[0]

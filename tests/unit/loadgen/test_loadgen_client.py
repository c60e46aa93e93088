"""The streaming client against a scripted server: SSE framing as servers really send it (CRLF, comments,
multi-line data, bytes split anywhere), per-chunk token accounting, usage totals and errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
import pytest
from aiohttp import web

from loadgen.client import OpenAIClient
from loadgen.metrics import CallRecord
from loadgen.sessions import CallOutput, CallRequest

Serve = Callable[[list[bytes]], Awaitable[str]]


@pytest.fixture
async def scripted() -> AsyncIterator[Serve]:
    """Start a server whose /v1/completions streams the given pieces, one write each (a pause between)."""
    runners: list[web.AppRunner] = []

    async def serve(pieces: list[bytes]) -> str:
        async def completions(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for piece in pieces:
                await resp.write(piece)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    yield serve
    for runner in runners:
        await runner.cleanup()


def event(obj: object, end: bytes = b"\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + end + end


def choice(text: str, ids: list[int] | None = None, finish: str | None = None) -> dict[str, object]:
    out: dict[str, object] = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        out["token_ids"] = ids
    return out


async def send(url: str, *, want_token_ids: bool = True) -> tuple[CallRecord, CallOutput]:
    request = CallRequest("s", 0, {"prompt": [1, 2, 3]}, max_tokens=4, prompt_tokens=3, ideal_cached_tokens=0)
    async with aiohttp.ClientSession() as http:
        client = OpenAIClient(http, url, "m", want_token_ids=want_token_ids)
        return await client.send(request, client.now())


async def test_crlf_comments_multiline_data_and_split_bytes(scripted: Serve) -> None:
    first = event({"choices": [choice("h", [7])]}, b"\r\n")
    coalesced = event({"choices": [choice("é✓z", [8, 9, 10])]}, b"\r\n")
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    stream = b": hi\r\n\r\n" + first + coalesced + event({"choices": [choice("", [], "length")]}, b"\r\n")
    stream += b"data: " + orjson.dumps(usage).replace(b",", b",\r\ndata: ", 1) + b"\r\n\r\n"  # 2 data lines
    stream += b"data:[DONE]\r\n\r\n"
    cut_in_char = len(b": hi\r\n\r\n") + len(first) + len(b'data: {"choices":[{"index":0,"text":"') + 1
    cut_in_crlf = len(b": hi\r\n\r\n") + len(first) - 1  # "\r" ends one write, "\n" starts the next
    pieces = [stream[:cut_in_crlf], stream[cut_in_crlf:cut_in_char], stream[cut_in_char:]]
    record, output = await send(await scripted(pieces))
    assert record.error is None and output.ok
    assert output.text == "hé✓z" and output.token_ids == [7, 8, 9, 10]
    assert record.chunk_tokens == [1, 3] and record.token_chunks == 2 and record.output_tokens == 4
    assert len(record.chunk_times_s) == 2 and record.chunk_times_s[1] > record.chunk_times_s[0]
    assert record.t_first_s == record.chunk_times_s[0] and record.t_end_s is not None
    assert record.prompt_tokens == 3


async def test_lone_cr_line_ends(scripted: Serve) -> None:
    stream = event({"choices": [choice("a")]}, b"\r") + event({"choices": [choice("b")]}, b"\r")
    record, output = await send(await scripted([stream, b"data: [DONE]\r", b"\r"]), want_token_ids=False)
    assert record.error is None and output.text == "ab" and record.output_tokens == 2


async def test_without_token_ids_a_text_chunk_is_one_token_and_usage_gives_the_total(scripted: Serve) -> None:
    pieces = [
        event({"choices": [choice("xy")]}),
        event({"choices": [choice("", finish="length")]}),  # only closes the stream: no token
        event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}),
        b"data: [DONE]\n\n",
    ]
    record, _ = await send(await scripted(pieces), want_token_ids=False)
    assert record.chunk_tokens == [1] and record.output_tokens == 2


async def test_token_ids_decide_when_the_server_sends_them(scripted: Serve) -> None:
    pieces = [
        event({"choices": [choice("a", [1, 2])]}),
        event({"choices": [choice("held back text", [])]}),  # text without tokens: not a token chunk
        b"data: [DONE]\n\n",
    ]
    record, output = await send(await scripted(pieces))
    assert record.chunk_tokens == [2] and record.output_tokens == 2  # no usage: the chunks' tokens
    assert output.token_ids == [1, 2]


async def test_an_error_event_ends_the_call(scripted: Serve) -> None:
    pieces = [event({"error": {"message": "engine died", "code": "engine_failed"}}), b"data: [DONE]\n\n"]
    record, output = await send(await scripted(pieces))
    assert (record.error, record.error_code, output.ok) == ("engine died", "engine_failed", False)


async def test_a_stream_without_done_is_incomplete(scripted: Serve) -> None:
    record, _ = await send(await scripted([event({"choices": [choice("a", [1])]})]))
    assert record.error_code == "incomplete_stream" and not record.ok


async def test_malformed_json_is_a_bad_stream(scripted: Serve) -> None:
    record, _ = await send(await scripted([b"data: {not json\n\n"]))
    assert record.error_code == "bad_stream"


async def test_http_errors_keep_status_and_message() -> None:
    async def refuse(request: web.Request) -> web.Response:
        body = {"error": {"message": "model 'x' not found", "code": "model_not_found"}}
        return web.json_response(body, status=404)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        record, _ = await send(f"http://127.0.0.1:{port}/v1")
    finally:
        await runner.cleanup()
    assert (record.status, record.error_code, record.error) == (404, "model_not_found", "model 'x' not found")

"""Slow clients: one that stops reading its stream is cut after the write timeout and the engine gives the
request's KV back (before, the request stayed in flight, past its deadline, for as long as the client kept
its socket open); one that stalls its request body gets a 408 after the read timeout (before, it held its
handler and connection as long)."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from tests.cluster import UpProcess
from tests.integration.test_ampd import metric
from tests.integration.test_api import engine_idle, sse_events, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    cluster = UpProcess(
        tmp_path_factory.mktemp("slow-client"),
        "--no-kv-store",
        "--router-arg=--stream-write-timeout-s 1",
        "--router-arg=--request-read-timeout-s 1",
        "--router-arg=--max-tokens-limit 4000",
    )
    yield cluster
    assert cluster.stop() == 0, cluster.log()


def _stuck_stream(url: str) -> socket.socket:
    """A streamed request of ~10 MB of events (top-20 logprobs per token) on a socket with a tiny receive
    window whose owner reads the headers and then nothing."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    body = orjson.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "stalled"}], "max_tokens": 4000,
         "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}
    )  # fmt: skip
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.settimeout(30)
    sock.connect((host, port))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


def _read_to_the_end(sock: socket.socket) -> bytes:
    got = bytearray()
    try:
        while chunk := sock.recv(1 << 20):
            got += chunk
    except ConnectionResetError:
        pass
    return bytes(got)


async def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(up: UpProcess) -> None:
    engine_url = next(u for name, u in up.services.items() if name.startswith("engine"))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        sock = await asyncio.to_thread(_stuck_stream, up.url)
        try:
            stalled = "kvpath_router_streams_stalled_total"
            await wait_until(lambda: _is_at_least(http, up.url, stalled, 1), timeout_s=60)
            await wait_until(lambda: engine_idle(http, engine_url), timeout_s=30)
            assert await metric(http, up.url, "kvpath_router_requests_running") == 0
            body = await asyncio.to_thread(_read_to_the_end, sock)  # what the kernel held, then the cut
            assert b"data: [DONE]" not in body
        finally:
            sock.close()
        # a client that reads, however the write timeout is short, gets its whole stream
        req = {"model": "tiny", "prompt": "fine", "max_tokens": 300, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}  # fmt: skip
        async with http.post(f"{up.url}/v1/completions", json=req) as resp:
            events = await sse_events(resp)
        assert events[-2]["usage"]["completion_tokens"] == 300
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert await metric(http, up.url, stalled) == 1


async def _is_at_least(http: aiohttp.ClientSession, url: str, name: str, value: float) -> bool:
    return await metric(http, url, name) >= value


def _send_and_answer(url: str, pieces: list[bytes], gap_s: float) -> tuple[bytes, float]:
    """Headers promising a 1,000-byte body, then `pieces` of it `gap_s` apart; the answer and how long after
    the headers it came."""
    sock = socket.create_connection((urlsplit(url).hostname, urlsplit(url).port), timeout=30)
    with sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")  # fmt: skip
        sent = time.monotonic()
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(gap_s)  # the client's pace is the fault here, not a wait for a condition
        answer = bytearray()
        while not _is_whole(answer):
            answer += sock.recv(65536)
        return bytes(answer), time.monotonic() - sent


def _is_whole(answer: bytearray) -> bool:
    head, sep, body = answer.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head.lower())
    return bool(sep) and length is not None and len(body) >= int(length.group(1))


@pytest.mark.parametrize("pieces", [[b'{"model"'], [b" "] * 12], ids=["stalled", "trickled"])
async def test_a_body_that_does_not_arrive_in_time_is_a_408(up: UpProcess, pieces: list[bytes]) -> None:
    answer, after_s = await asyncio.to_thread(_send_and_answer, up.url, pieces, 0.25)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"connection: close" in head.lower()
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert after_s < 5  # the read timeout is 1 s

"""Long prompts at the router (SmolLM2's tokenizer, `kvpath up`): a body of megabytes is tokenized by a
worker thread while the event loop keeps streaming other requests' tokens, and a prompt longer than the
context could ever hold is refused without tokenizing it."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    """A large JSON body (aiohttp's client warns about posting megabytes of raw bytes)."""
    data = io.BytesIO(orjson.dumps(body))
    return http.post(url, data=data, headers={"Content-Type": "application/json"})


async def _stream_arrivals(
    http: aiohttp.ClientSession, url: str, started: asyncio.Event, done: asyncio.Event
) -> list[float]:
    """When each chunk of a long greedy stream arrived, until `done` (the stream is then dropped)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals = []
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 5:
                    started.set()
                if done.is_set():
                    break
    return arrivals


async def test_a_megabytes_prompt_is_tokenized_while_other_streams_flow(
    smollm2_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    """/tokenize of 4 MB takes the tokenizer ~2 s here; the stream's chunks keep arriving meanwhile (on the
    event loop, before: none did until it was done, then the held ones all at once)."""
    url = smollm2_cluster.url
    started, done = asyncio.Event(), asyncio.Event()
    stream = asyncio.create_task(_stream_arrivals(http, url, started, done))
    await asyncio.wait_for(started.wait(), 60)
    text = "The quick brown fox jumps over the lazy dog, again and again. " * 64_000
    sent = time.monotonic()
    async with _post(http, f"{url}/tokenize", {"model": "smollm2", "prompt": text}) as resp:
        assert resp.status == 200, await resp.text()
        count = (await resp.json())["count"]
    answered = time.monotonic()
    done.set()
    arrivals = await asyncio.wait_for(stream, 120)
    assert count > 500_000
    during = [t for t in arrivals if sent < t < answered]
    # tokens streamed throughout the tokenization: several chunks, and none waited more than half of it
    assert len(during) >= 3, (len(during), answered - sent)
    gaps = [b - a for a, b in zip([sent, *during], [*during, answered], strict=True)]
    assert max(gaps) < (answered - sent) / 2, gaps


async def test_a_prompt_longer_than_any_context_is_refused_without_tokenizing_it(
    smollm2_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    url = smollm2_cluster.url
    huge = "word " * 2_000_000  # 10 MB: at least 123k of SmolLM2's tokens (at most 81 bytes each)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": huge}], "max_tokens": 4}
    async with _post(http, f"{url}/v1/chat/completions", body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "context_length_exceeded", error
        assert "at least" in error["message"] and error["param"] == "messages"
    # under that bound the prompt is tokenized (in the worker thread) and counted exactly
    body = {"model": "smollm2", "prompt": "word " * 20_000, "max_tokens": 4}
    async with _post(http, f"{url}/v1/completions", body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "context_length_exceeded", error
        assert "your prompt has 20001 tokens" in error["message"]  # BOS and the 20,000 words
    # a body of 32 KB (in ignored metadata) is prepared off the loop too, and served
    ok = {"model": "smollm2", "prompt": "word " * 100, "max_tokens": 2, "metadata": {"pad": "x" * (32 << 10)}}
    async with _post(http, f"{url}/v1/completions", ok) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["usage"]["prompt_tokens"] == 101

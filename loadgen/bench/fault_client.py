"""The client side of `kvpath bench faults`: streams that report how they ended, recovery and hit probes.

A stream's outcome is what a client sees: `ok` (a finish reason, then `[DONE]`), `error` (an error event or an
HTTP error in OpenAI's shape, and the stream still ended), or `hung` (nothing ended it within its deadline:
the one outcome no fault may produce).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

HANG_S = 60.0  # a stream not ended within this is hung


@dataclass(slots=True)
class StreamEnd:
    outcome: str  # ok | error | hung
    status: int = 0
    message: str = ""
    tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float = 0.0  # monotonic time of the first token (0: none)


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 240 + 3 for i in range(num_tokens)]


async def stream(
    http: aiohttp.ClientSession,
    url: str,
    tokens: list[int],
    max_tokens: int,
    *,
    started: asyncio.Event | None = None,
    extra: dict[str, object] | None = None,
) -> StreamEnd:
    """One streamed completion; `started` is set at its first token."""
    body = {"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    end = StreamEnd("hung")
    try:
        async with asyncio.timeout(HANG_S):
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                end.status = resp.status
                if resp.status != 200:
                    error = (await resp.json()).get("error", {})
                    return StreamEnd("error", resp.status, str(error.get("message", "")))
                await _read_events(resp, end, started)
    except TimeoutError:
        return end
    except aiohttp.ClientError as exc:
        return StreamEnd("error", end.status, f"connection: {exc}")
    return end


async def _read_events(resp: aiohttp.ClientResponse, end: StreamEnd, started: asyncio.Event | None) -> None:
    finished = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            end.outcome = "ok" if finished and end.outcome != "error" else "error"
            return
        event = json.loads(data)
        if "error" in event:
            end.outcome, end.message = "error", str(event["error"].get("message", ""))
            continue
        for choice in event.get("choices", []):
            if not end.first_token_at:
                end.first_token_at = time.monotonic()
                if started is not None:
                    started.set()
            finished = finished or bool(choice.get("finish_reason"))
        usage = event.get("usage") or {}
        end.tokens = usage.get("completion_tokens", end.tokens)
        end.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", end.cached_tokens)
    end.outcome = "error"  # the connection ended without [DONE]
    end.message = end.message or "stream ended without [DONE]"


async def complete(
    http: aiohttp.ClientSession, url: str, tokens: list[int], max_tokens: int = 4
) -> StreamEnd:
    return await stream(http, url, tokens, max_tokens)


async def until_served(
    http: aiohttp.ClientSession, url: str, since: float, timeout_s: float = 120.0
) -> float:
    """Seconds from `since` (monotonic) until a request succeeds again; inf if none does in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await complete(http, url, prompt(999, 40))).outcome == "ok":
            return time.monotonic() - since
        await asyncio.sleep(0.2)
    return float("inf")


async def hit_tokens(
    http: aiohttp.ClientSession, url: str, tokens: list[int], want: int, timeout_s: float
) -> int:
    """The warm prompt's cached tokens, asked until it reaches `want` (replays, restarts) or time is up."""
    deadline = time.monotonic() + timeout_s
    cached = 0
    while True:
        end = await complete(http, url, tokens)
        cached = max(cached, end.cached_tokens) if end.outcome == "ok" else cached
        if cached >= want or time.monotonic() > deadline:
            return cached
        await asyncio.sleep(0.3)

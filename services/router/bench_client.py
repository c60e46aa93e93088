"""The client of `kvpath bench serve`: many concurrent OpenAI streaming completions, timed per SSE chunk.

Works against any OpenAI-compatible server. Prompts are random token ids (so no two requests share a prefix
unless `shared_prefix_tokens` asks for one). By default it sends two extensions that kvpath (and vLLM)
understand: `ignore_eos` (every request generates exactly `max_tokens`) and `return_token_ids` (each chunk
lists its tokens, so a chunk that carries several coalesced tokens is counted exactly). `openai_only` drops
both: a chunk with text then counts as one token, and totals come from the `usage` chunk.

ITL is per token: a chunk carrying n tokens that arrives `gap` after the previous token-bearing chunk gives
n samples of gap / n (so mean ITL x tokens = decode time, as with one token per chunk).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import orjson


@dataclass(slots=True)
class ServeBenchConfig:
    url: str
    model: str = ""  # empty: the first model of GET /v1/models
    concurrency: int = 8
    num_requests: int = 64
    prompt_tokens: int = 128
    max_tokens: int = 128
    shared_prefix_tokens: int = 0  # this many leading prompt tokens are the same in every request
    prompt_token_lo: int = 32  # prompt token ids are drawn from [lo, hi)
    prompt_token_hi: int = 127
    openai_only: bool = False  # no ignore_eos / return_token_ids extensions
    request_timeout_s: float = 600.0
    seed: int = 0

    def validate(self) -> None:
        if self.concurrency < 1 or self.num_requests < 1 or self.max_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError("concurrency, requests, prompt tokens and max tokens must all be >= 1")
        if not 0 <= self.shared_prefix_tokens <= self.prompt_tokens:
            raise ValueError("shared prefix tokens must be between 0 and the prompt tokens")
        if not 0 <= self.prompt_token_lo < self.prompt_token_hi:
            raise ValueError("prompt token id range must be 0 <= lo < hi")


@dataclass(slots=True)
class RequestRecord:
    """What one request saw: send time, arrival time and token count of every token-bearing chunk."""

    started_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    usage_completion_tokens: int = -1
    finished_s: float = 0.0
    error: str = ""

    @property
    def num_tokens(self) -> int:
        return self.usage_completion_tokens if self.usage_completion_tokens >= 0 else sum(self.chunk_tokens)


def request_body(cfg: ServeBenchConfig, model: str, rng: random.Random, prefix: list[int]) -> dict[str, Any]:
    lo, hi = cfg.prompt_token_lo, cfg.prompt_token_hi
    prompt = prefix + [rng.randrange(lo, hi) for _ in range(cfg.prompt_tokens - len(prefix))]
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not cfg.openai_only:
        body["ignore_eos"] = True
        body["return_token_ids"] = True
    return body


def parse_events(buffer: bytearray) -> list[bytes]:
    """Cut the complete `data: ...` payloads off the front of `buffer` (the rest stays for the next read)."""
    end = buffer.rfind(b"\n\n")
    if end < 0:
        return []
    block = bytes(buffer[:end])
    del buffer[: end + 2]
    return [e[6:] if e.startswith(b"data: ") else e for e in block.split(b"\n\n") if e]


def apply_event(record: RequestRecord, payload: bytes, arrived_s: float, exact: bool) -> bool:
    """Account one SSE payload; return True at `[DONE]`."""
    if payload == b"[DONE]":
        return True
    obj = orjson.loads(payload)
    if "error" in obj:
        record.error = str(obj["error"].get("message", obj["error"]))[:200]
        return False
    choices = obj.get("choices")
    if not choices:
        usage = obj.get("usage")
        if usage:
            record.usage_completion_tokens = int(usage.get("completion_tokens", -1))
        return False
    choice = choices[0]
    if exact:
        num_tokens = len(choice.get("token_ids") or ())
    else:
        num_tokens = 1 if choice.get("text") else 0
    if num_tokens:
        record.chunk_times_s.append(arrived_s)
        record.chunk_tokens.append(num_tokens)
    return False


async def stream_one(
    http: aiohttp.ClientSession, cfg: ServeBenchConfig, body: dict[str, Any]
) -> RequestRecord:
    record = RequestRecord(started_s=time.perf_counter())
    try:
        async with http.post(f"{cfg.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            buffer = bytearray()
            is_done = False
            async for data in resp.content.iter_any():
                arrived_s = time.perf_counter()
                buffer += data
                for payload in parse_events(buffer):
                    is_done = apply_event(record, payload, arrived_s, not cfg.openai_only) or is_done
            if not is_done and not record.error:
                record.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.finished_s = time.perf_counter()
    if not record.error and not cfg.openai_only and record.num_tokens != cfg.max_tokens:
        record.error = f"got {record.num_tokens} tokens, expected {cfg.max_tokens}"
    return record


async def first_model(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json(loads=orjson.loads))["data"]
    if not data:
        raise ValueError(f"{url} serves no model")
    return str(data[0]["id"])


async def run_serve_bench(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Send `num_requests` streaming requests, `concurrency` at a time; return `summarize`'s dict."""
    cfg.validate()
    cfg.url = cfg.url.rstrip("/")
    rng = random.Random(cfg.seed)
    prefix = [
        rng.randrange(cfg.prompt_token_lo, cfg.prompt_token_hi) for _ in range(cfg.shared_prefix_tokens)
    ]
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=cfg.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        model = cfg.model or await first_model(http, cfg.url)
        bodies = [request_body(cfg, model, rng, prefix) for _ in range(cfg.num_requests)]
        records: list[RequestRecord] = []

        async def worker() -> None:
            while bodies:
                records.append(await stream_one(http, cfg, bodies.pop()))

        started_unix, started_s = time.time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, cfg.num_requests))))
        duration_s = time.perf_counter() - started_s
    out = summarize(records, duration_s, cfg.concurrency)
    out.update(
        url=cfg.url,
        model=model,
        concurrency=cfg.concurrency,
        prompt_tokens=cfg.prompt_tokens,
        max_tokens=cfg.max_tokens,
        started_unix=started_unix,
        finished_unix=started_unix + duration_s,
    )
    return out


def _pcts(samples: list[float] | np.ndarray, scale: float) -> dict[str, float]:
    arr = np.asarray(samples, dtype=np.float64)
    if arr.size == 0:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    p50, p99 = np.percentile(arr, [50, 99])
    return {"p50": float(p50 * scale), "p99": float(p99 * scale), "mean": float(arr.mean() * scale)}


def itl_samples(record: RequestRecord) -> np.ndarray:
    """Per-token inter-token latencies of one request (seconds); see the module docstring."""
    if len(record.chunk_times_s) < 2:
        return np.empty(0)
    gaps = np.diff(np.asarray(record.chunk_times_s))
    counts = np.asarray(record.chunk_tokens[1:])
    return np.repeat(gaps / counts, counts)


def steady_window(records: list[RequestRecord], concurrency: int) -> tuple[float, float, int]:
    """(start, end, tokens) of the span in which every stream slot was streaming.

    It starts once each of the first `concurrency` requests has its first token and ends when the first of
    the last `concurrency` requests ends; (0, 0, 0) when they do not overlap (or a request failed).
    """
    if not records or any(r.error or not r.chunk_times_s for r in records):
        return 0.0, 0.0, 0
    by_start = sorted(records, key=lambda r: r.started_s)
    c = min(concurrency, len(records))
    start = max(r.chunk_times_s[0] for r in by_start[:c])
    end = min(r.chunk_times_s[-1] for r in by_start[-c:])
    if end <= start:
        return 0.0, 0.0, 0
    tokens = 0
    for r in records:
        times = np.asarray(r.chunk_times_s)
        counts = np.asarray(r.chunk_tokens)
        tokens += int(counts[(times > start) & (times <= end)].sum())
    return start, end, tokens


def summarize(records: list[RequestRecord], duration_s: float, concurrency: int = 1) -> dict[str, Any]:
    """Totals and percentiles; times in the output are relative to the first request's start."""
    ok = [r for r in records if not r.error]
    failed = [r for r in records if r.error]
    num_tokens = sum(r.num_tokens for r in ok)
    num_chunks = sum(len(r.chunk_tokens) for r in ok)
    itl = [itl_samples(r) for r in ok]
    origin = min((r.started_s for r in records), default=0.0)
    steady_start, steady_end, steady_tokens = steady_window(records, concurrency)
    steady_s = steady_end - steady_start
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "duration_s": duration_s,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "tokens_per_chunk": num_tokens / num_chunks if num_chunks else 0.0,
        "ttft_ms": _pcts([r.chunk_times_s[0] - r.started_s for r in ok if r.chunk_times_s], 1e3),
        "itl_ms": _pcts(np.concatenate(itl) if itl else [], 1e3),
        "e2e_s": _pcts([r.finished_s - r.started_s for r in ok], 1.0),
        "steady_window_s": [steady_start - origin, steady_end - origin] if steady_s > 0 else [],
        "steady_tokens_per_s": steady_tokens / steady_s if steady_s > 0 else 0.0,
    }


def format_summary(out: dict[str, Any]) -> str:
    ttft, itl, e2e = out["ttft_ms"], out["itl_ms"], out["e2e_s"]
    lines = [
        f"bench serve: {out['url']} model={out['model']} concurrency={out['concurrency']} "
        f"prompt={out['prompt_tokens']} max_tokens={out['max_tokens']}",
        f"  requests ok / failed : {out['num_ok']} / {out['num_failed']}"
        + (f"  (first error: {out['first_error']})" if out["first_error"] else ""),
        f"  duration             : {out['duration_s']:.2f} s",
        f"  output tokens/s      : {out['output_tokens_per_s']:,.1f}  ({out['output_tokens']:,} tokens; "
        f"{out['steady_tokens_per_s']:,.1f} while every stream was busy)",
        f"  requests/s           : {out['requests_per_s']:.2f}",
        f"  TTFT p50 / p99       : {ttft['p50']:.1f} / {ttft['p99']:.1f} ms",
        f"  ITL  p50 / p99       : {itl['p50']:.2f} / {itl['p99']:.2f} ms (per token)",
        f"  e2e  p50 / p99       : {e2e['p50']:.2f} / {e2e['p99']:.2f} s",
        f"  tokens per SSE chunk : {out['tokens_per_chunk']:.2f}",
    ]
    return "\n".join(lines)

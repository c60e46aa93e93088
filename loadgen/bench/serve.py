"""`kvpath bench serve`: many concurrent OpenAI streaming completions against any server, timed per SSE chunk.

tokens/s, req/s, TTFT, ITL and e2e percentiles, through the load generator's client (`loadgen.client`).
Prompts are random token ids (so no two requests share a prefix unless `shared_prefix_tokens` asks for one).
By default it sends two extensions that kvpath (and vLLM) understand: `ignore_eos` (with `min_tokens`: every
request generates exactly `max_tokens`) and `return_token_ids` (each chunk lists its tokens, so a chunk that
carries several coalesced tokens is counted exactly). `openai_only` drops them: a chunk with text then
counts as one token, and totals come from the `usage` chunk.

ITL is per token: a chunk carrying n tokens that arrives `gap` after the previous token-bearing chunk gives
n samples of gap / n (so mean ITL x tokens = decode time, as with one token per chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from loadgen.client import OpenAIClient, first_model
from loadgen.metrics import CallRecord
from loadgen.sessions import CallRequest
from shared.errors import KvpathError


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
    openai_only: bool = False  # no ignore_eos / min_tokens / return_token_ids extensions
    request_timeout_s: float = 600.0
    seed: int = 0

    def validate(self) -> None:
        if self.concurrency < 1 or self.num_requests < 1 or self.max_tokens < 1 or self.prompt_tokens < 1:
            raise ValueError("concurrency, requests, prompt tokens and max tokens must all be >= 1")
        if not 0 <= self.shared_prefix_tokens <= self.prompt_tokens:
            raise ValueError("shared prefix tokens must be between 0 and the prompt tokens")
        if not 0 <= self.prompt_token_lo < self.prompt_token_hi:
            raise ValueError("prompt token id range must be 0 <= lo < hi")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI streaming client: tokens/s, TTFT, ITL (any server)")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=64, help="requests in all")
    p.add_argument("--prompt-tokens", type=int, default=128, help="random prompt token ids per request")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, help="leading prompt tokens all share")
    p.add_argument("--token-id-range", type=int, nargs=2, default=(32, 127), metavar=("LO", "HI"))
    p.add_argument("--openai-only", action="store_true", help="no ignore_eos / return_token_ids extensions")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    p.add_argument("--json", default="", help="also write the results to this file")
    p.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    lo, hi = args.token_id_range
    cfg = ServeBenchConfig(
        url=args.url,
        model=args.model,
        concurrency=args.concurrency,
        num_requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        shared_prefix_tokens=args.shared_prefix_tokens,
        prompt_token_lo=lo,
        prompt_token_hi=hi,
        openai_only=args.openai_only,
        seed=args.seed,
    )
    try:
        out = run_async(run_serve_bench(cfg))
    except (ValueError, KvpathError, aiohttp.ClientError, OSError) as exc:
        print(f"kvpath bench serve: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(format_summary(out), flush=True)
    if args.json:
        Path(args.json).write_bytes(
            orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
        )
    return 0 if out["num_failed"] == 0 and out["num_ok"] > 0 else 1


def run_async(coro: Any) -> Any:
    from shared.service import install_uvloop

    install_uvloop()
    return asyncio.run(coro)


def bench_requests(cfg: ServeBenchConfig) -> list[CallRequest]:
    """The requests in the order they are sent (last first); the same for the same seed."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.prompt_token_lo, cfg.prompt_token_hi
    prefix = [rng.randrange(lo, hi) for _ in range(cfg.shared_prefix_tokens)]
    requests = []
    for i in range(cfg.num_requests):
        prompt = prefix + [rng.randrange(lo, hi) for _ in range(cfg.prompt_tokens - len(prefix))]
        payload = {"prompt": prompt}
        requests.append(CallRequest(f"bench-{i}", 0, payload, cfg.max_tokens, len(prompt), None))
    return requests


async def run_serve_bench(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Send `num_requests` streaming requests, `concurrency` at a time; return `summarize`'s dict."""
    cfg.validate()
    cfg.url = cfg.url.rstrip("/")
    requests = bench_requests(cfg)
    connector = aiohttp.TCPConnector(limit=cfg.concurrency)
    async with aiohttp.ClientSession(connector=connector) as http:
        model = cfg.model or await first_model(http, cfg.url)
        client = OpenAIClient(
            http,
            cfg.url,
            model,
            exact_lengths=not cfg.openai_only,
            want_token_ids=not cfg.openai_only,
            session_header=False,
            timeout_s=cfg.request_timeout_s,
            clock=time.perf_counter,
        )
        records: list[CallRecord] = []

        async def worker() -> None:
            while requests:
                record, _ = await client.send(requests.pop(), client.now())
                records.append(judge(record, cfg))

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


def judge(record: CallRecord, cfg: ServeBenchConfig) -> CallRecord:
    """The bench's verdict in `record.error`: the client's error (with the HTTP status of a refusal), or
    the wrong number of tokens when every request must generate exactly `max_tokens`."""
    if record.error is not None:
        if record.status >= 400:
            record.error = f"HTTP {record.status}: {record.error}"
    elif not cfg.openai_only and record.output_tokens != cfg.max_tokens:
        record.error = f"got {record.output_tokens} tokens, expected {cfg.max_tokens}"
        record.error_code = "length_mismatch"
    return record


def _pcts(samples: list[float] | np.ndarray, scale: float) -> dict[str, float]:
    arr = np.asarray(samples, dtype=np.float64)
    if arr.size == 0:
        return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}
    p50, p99 = np.percentile(arr, [50, 99])
    return {"p50": float(p50 * scale), "p99": float(p99 * scale), "mean": float(arr.mean() * scale)}


def itl_samples(record: CallRecord) -> np.ndarray:
    """Per-token inter-token latencies of one request (seconds); see the module docstring."""
    if len(record.chunk_times_s) < 2:
        return np.empty(0)
    gaps = np.diff(np.asarray(record.chunk_times_s))
    counts = np.asarray(record.chunk_tokens[1:])
    return np.repeat(gaps / counts, counts)


def steady_window(records: list[CallRecord], concurrency: int) -> tuple[float, float, int]:
    """(start, end, tokens) of the span in which every stream slot was streaming.

    It starts once each of the first `concurrency` requests has its first token and ends when the first of
    the last `concurrency` requests ends; (0, 0, 0) when they do not overlap (or a request failed).
    """
    if not records or any(r.error is not None or not r.chunk_times_s for r in records):
        return 0.0, 0.0, 0
    by_start = sorted(records, key=lambda r: r.t_start_s)
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


def summarize(records: list[CallRecord], duration_s: float, concurrency: int = 1) -> dict[str, Any]:
    """Totals and percentiles of judged records (see `judge`); times in the output are relative to the first
    request's start."""
    ok = [r for r in records if r.error is None]
    failed = [r.error for r in records if r.error is not None]
    num_tokens = sum(r.output_tokens for r in ok)
    num_chunks = sum(len(r.chunk_tokens) for r in ok)
    itl = [itl_samples(r) for r in ok]
    origin = min((r.t_start_s for r in records), default=0.0)
    steady_start, steady_end, steady_tokens = steady_window(records, concurrency)
    steady_s = steady_end - steady_start
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(failed),
        "first_error": failed[0] if failed else "",
        "duration_s": duration_s,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "tokens_per_chunk": num_tokens / num_chunks if num_chunks else 0.0,
        "ttft_ms": _pcts([r.chunk_times_s[0] - r.t_start_s for r in ok if r.chunk_times_s], 1e3),
        "itl_ms": _pcts(np.concatenate(itl) if itl else [], 1e3),
        "e2e_s": _pcts([(r.t_end_s or r.t_start_s) - r.t_start_s for r in ok], 1.0),
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

"""Serving with a shared KV pool vs the remote-memory pool baseline, for `kvpath bench beluga`: the Beluga
paper's two-run protocol on an LV-Eval-like workload (long shared documents, many short questions each).

Each tier is a real `kvpath up` cluster of colocated engines with its default policy: `--kv-tier pool`
(Beluga: the CXL-style pool, cache-oblivious `beluga` placement) and `--kv-tier remote` (vLLM + Mooncake
store style: a remote DRAM store reached over tcp, 256-token super blocks, an engine-local DRAM cache,
cache-aware placement). The same workload runs on both, one after the other:
  populate   every document once (document + a question), so the tier holds every document's KV;
  sweep      the cache-hit run at each request rate of `rates` (Poisson arrivals, open loop, the same
             arrivals on both tiers): Fig. 11's shape, TTFT against load;
  peak       `clients` closed-loop clients for `duration_s`: peak throughput (QPS), as Table 5.
Each question is about a document drawn with Zipf popularity (`zipf`: a few hot documents, a long tail).
Prompts are token ids drawn from the model's ordinary vocabulary (never its control tokens).
Sizing (0 = derived from the working set, every document's KV in the model's fp32 KV on the CPU): the pool
and the remote store get the same capacity (the paper's fairness rule), 1.5x the working set, so the hit
run finds every document in either; each baseline engine's local DRAM cache holds a sixth of the working set
(a shared pool's working set outgrows one host's DRAM); each engine's paged cache (HBM) is `kv_cache_bytes`.
Reported per phase: TTFT mean/p99, the KV-load stage (the engine's `read`, fetching the hit prefix into
reach, plus `import`, copying it into the cache, from the router's stage histogram over that phase alone),
QPS, the cached-token share.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import statistics
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadgen.bench.scrape import scrape, stage_totals
from loadgen.client import OpenAIClient
from loadgen.metrics import CallRecord
from loadgen.sessions import CallRequest

TIERS = ("pool", "remote")
KV_LOAD_STAGES = ("read", "import")
STAGES = (*KV_LOAD_STAGES, "prefill")
_BYTE_MODEL_TOKENS = (3, 250)  # token ids the embedded models' byte vocabulary takes as plain text
POOL_SHARE = 1.5  # pool (and remote store) capacity / working set: documents plus the questions' blocks
REMOTE_CACHE_SHARE = 1 / 6  # a baseline engine's local DRAM cache / working set


@dataclass(slots=True)
class ServeOptions:
    model: str = "smollm2"
    engines: int = 2
    docs: int = 16
    # documents of arbitrary length leave 31.5 tokens on average after their last whole 64-token block, which
    # no tier can hit (computed with the question on both): 6,048 tokens leave 32
    doc_tokens: int = 6048
    question_tokens: int = 32
    max_tokens: int = 8
    # requests/s of the open-loop sweep, up to about the two engines' capacity on two cores (a SmolLM2 hit
    # request costs ~1 s of compute: its last 64 tokens over 6k positions, then 7 decode steps)
    rates: tuple[float, ...] = (0.3, 0.6, 0.9)
    rate_duration_s: float = 30.0  # arrivals per rate
    clients: int = 4  # closed-loop clients of the peak run
    duration_s: float = 40.0  # of the peak run
    zipf: float = 1.0
    pool_bytes: int = 0  # pool and remote store capacity (0: POOL_SHARE x the working set)
    remote_cache_bytes: int = 0  # a baseline engine's local DRAM cache (0: REMOTE_CACHE_SHARE x working set)
    kv_cache_bytes: int = 1 << 30  # each engine's paged KV cache (0: the engine's default)
    seed: int = 0
    up_args: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if min(self.engines, self.docs, self.doc_tokens, self.question_tokens, self.max_tokens) < 1:
            raise ValueError("engines, docs, doc tokens, question tokens and max tokens must be >= 1")
        if self.clients < 1 or self.duration_s <= 0 or self.rate_duration_s <= 0:
            raise ValueError("clients must be >= 1 and the durations > 0")
        if any(r <= 0 for r in self.rates):
            raise ValueError(f"request rates must be > 0, got {self.rates}")
        if min(self.pool_bytes, self.remote_cache_bytes, self.kv_cache_bytes) < 0:
            raise ValueError("pool, remote cache and KV cache bytes must be >= 0 (0: derived)")

    def working_set_bytes(self) -> int:
        """Every document's KV, at the model's KV bytes per token (fp32, the CPU engines' dtype)."""
        from gpu.model_spec import load_model_spec

        spec = load_model_spec(self.model)
        return self.docs * self.doc_tokens * spec.num_layers * spec.kv_bytes_per_token_layer("float32")

    def cluster_args(self, tier: str) -> list[str]:
        """`kvpath up` flags of a tier's cluster: its sizes, then the caller's extra flags."""
        working_set = self.working_set_bytes()
        args = ["--model", self.model, "--engines", str(self.engines), "--kv-tier", tier]
        args += ["--prefill-order", "fcfs", "--step-target-s", "0"]  # as the README's table was measured
        args += ["--pool-bytes", str(self.pool_bytes or int(POOL_SHARE * working_set))]
        if self.kv_cache_bytes:
            args.append(f"--engine-arg=--kv-cache-bytes {self.kv_cache_bytes}")
        if tier == "remote":
            cache = self.remote_cache_bytes or int(REMOTE_CACHE_SHARE * working_set)
            args.append(f"--engine-arg=--remote-cache-bytes {cache}")
        return [*args, *self.up_args]


@dataclass(slots=True)
class PhaseResult:
    phase: str  # "rate=<r>" or "peak"
    requests: int
    failed: int
    duration_s: float
    qps: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    kv_load_mean_s: float  # read + import stage means
    stages_mean_s: dict[str, float]
    cached_share: float  # cached prompt tokens / prompt tokens
    ttfts_s: list[float] = field(default_factory=list, repr=False)


@dataclass(slots=True)
class ServeResult:
    tier: str
    policy: str
    populate_s: float
    sweep: list[PhaseResult]
    peak: PhaseResult
    sweep_ttft_mean_s: float  # over every request of the sweep
    sweep_ttft_p99_s: float
    sweep_kv_load_mean_s: float

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for phase in (*out["sweep"], out["peak"]):
            phase.pop("ttfts_s")
        return out


def run_serving(opts: ServeOptions, work: Path) -> list[ServeResult]:
    opts.validate()
    return [asyncio.run(_run_tier(tier, opts, work / tier)) for tier in TIERS]


@functools.cache
def token_ids(model: str) -> np.ndarray:
    """The ids prompts are drawn from: the model's vocabulary less its special (control) tokens, which a
    real document never holds; the embedded models' printable bytes."""
    from gpu.model_spec import EMBEDDED_MODELS, load_model_spec
    from gpu.tokenizer import load_tokenizer

    if model in EMBEDDED_MODELS:
        return np.arange(*_BYTE_MODEL_TOKENS, dtype=np.int64)
    spec = load_model_spec(model)
    added = json.loads(load_tokenizer(spec.model_dir).backend_json()).get("added_tokens", [])
    special = [token["id"] for token in added if token.get("special")]
    return np.setdiff1d(np.arange(spec.vocab_size, dtype=np.int64), np.asarray(special, dtype=np.int64))


def _documents(opts: ServeOptions) -> list[list[int]]:
    rng = np.random.default_rng(opts.seed)
    ids = token_ids(opts.model)
    return [ids[rng.integers(0, len(ids), opts.doc_tokens)].tolist() for _ in range(opts.docs)]


def _question(rng: random.Random, ids: np.ndarray, n: int) -> list[int]:
    return [int(ids[rng.randrange(len(ids))]) for _ in range(n)]


class _Questions:
    """Which document each question is about (Zipf popularity over a shuffled order, so the hot documents
    are not the ones populated first or last) and its tokens, from one seeded generator per phase."""

    def __init__(self, opts: ServeOptions, seed: int) -> None:
        self.opts = opts
        self.rng = random.Random(seed)
        order = list(range(opts.docs))
        random.Random(opts.seed).shuffle(order)
        self.order = order
        self.weights = [1.0 / (rank + 1) ** opts.zipf for rank in range(opts.docs)]
        self.count = 0

    def next(self, docs: list[list[int]]) -> CallRequest:
        doc_id = self.order[self.rng.choices(range(len(self.order)), self.weights)[0]]
        question = _question(self.rng, token_ids(self.opts.model), self.opts.question_tokens)
        self.count += 1
        return _request(doc_id, docs[doc_id], question, self.opts, self.count)


async def _run_tier(tier: str, opts: ServeOptions, work: Path) -> ServeResult:
    from services.up.process import UpProcess

    await asyncio.to_thread(work.mkdir, parents=True, exist_ok=True)
    up = await asyncio.to_thread(UpProcess, work, *opts.cluster_args(tier), timeout_s=600.0)
    try:
        return await _drive(tier, opts, up.url)
    finally:
        await asyncio.to_thread(up.stop)


async def _drive(tier: str, opts: ServeOptions, url: str) -> ServeResult:
    docs = _documents(opts)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        client = OpenAIClient(http, url, opts.model, timeout_s=120.0, want_token_ids=True)
        started = time.monotonic()
        await _populate(client, docs, opts)
        populate_s = time.monotonic() - started
        sweep = []
        for i, rate in enumerate(opts.rates):
            questions = _Questions(opts, opts.seed + 100 + i)
            run = _open_loop(client, docs, questions, rate, opts.rate_duration_s)
            sweep.append(await _phase(http, url, f"rate={rate:g}", run))
        questions = _Questions(opts, opts.seed + 1)
        peak = await _phase(http, url, "peak", _closed_loop(client, docs, questions, opts))
    ttfts = sorted(t for p in sweep for t in p.ttfts_s)
    counts = [p.requests for p in sweep]
    return ServeResult(
        tier=tier,
        policy=_policy(tier, opts.up_args),
        populate_s=populate_s,
        sweep=sweep,
        peak=peak,
        sweep_ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        sweep_ttft_p99_s=_percentile(ttfts, 0.99),
        sweep_kv_load_mean_s=(
            sum(p.kv_load_mean_s * n for p, n in zip(sweep, counts, strict=True)) / sum(counts)
            if sum(counts)
            else 0.0
        ),
    )


async def _phase(
    http: aiohttp.ClientSession, url: str, name: str, run: Awaitable[list[CallRecord]]
) -> PhaseResult:
    before = stage_totals(await scrape(http, url), STAGES)
    records = await run
    after = stage_totals(await scrape(http, url), STAGES)
    stages = {}
    for stage in STAGES:
        count = after[stage][1] - before[stage][1]
        stages[stage] = (after[stage][0] - before[stage][0]) / count if count else 0.0
    ok = [r for r in records if r.ok]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    span = max((r.t_end_s or 0.0) for r in ok) - min(r.t_start_s for r in ok) if ok else 0.0
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    return PhaseResult(
        phase=name,
        requests=len(ok),
        failed=len(records) - len(ok),
        duration_s=span,
        qps=len(ok) / span if span > 0 else 0.0,
        ttft_mean_s=statistics.fmean(ttfts) if ttfts else 0.0,
        ttft_p50_s=_percentile(ttfts, 0.5),
        ttft_p99_s=_percentile(ttfts, 0.99),
        kv_load_mean_s=sum(stages[s] for s in KV_LOAD_STAGES),
        stages_mean_s=stages,
        cached_share=sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else 0.0,
        ttfts_s=ttfts,
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _policy(tier: str, up_args: list[str]) -> str:
    """The placement policy the cluster runs: `kvpath up`'s default for the tier unless overridden."""
    from services.policy.colocated import BELUGA, CACHE_AWARE

    for i, arg in enumerate(up_args):
        if arg.startswith("--policy="):
            return arg.split("=", 1)[1]
        if arg == "--policy" and i + 1 < len(up_args):
            return up_args[i + 1]
    return BELUGA if tier == "pool" else CACHE_AWARE


def _request(doc_id: int, doc: list[int], question: list[int], opts: ServeOptions, turn: int) -> CallRequest:
    prompt = doc + question
    return CallRequest(
        session_id=f"doc{doc_id}-q{turn}",
        turn=1,
        payload={"prompt": prompt},
        max_tokens=opts.max_tokens,
        prompt_tokens=len(prompt),
        ideal_cached_tokens=len(doc),
    )


async def _populate(client: OpenAIClient, docs: list[list[int]], opts: ServeOptions) -> None:
    """Every document once, one per engine at a time (a long prefill each); any failure ends the bench (the
    tier would be half full)."""
    queue = list(enumerate(docs))
    rng = random.Random(opts.seed + 2)

    async def worker() -> None:
        while queue:
            doc_id, doc = queue.pop()
            question = _question(rng, token_ids(opts.model), opts.question_tokens)
            record, _ = await client.send(_request(doc_id, doc, question, opts, 0), client.now())
            if not record.ok:
                raise RuntimeError(f"populate request for document {doc_id} failed: {record.error}")

    await asyncio.gather(*(worker() for _ in range(opts.engines)))


async def _open_loop(
    client: OpenAIClient, docs: list[list[int]], questions: _Questions, rate: float, duration_s: float
) -> list[CallRecord]:
    """Poisson arrivals at `rate` for `duration_s`; returns once every request has finished."""
    records: list[CallRecord] = []
    tasks: list[asyncio.Task[Any]] = []
    arrivals = random.Random(questions.rng.random())
    start = time.monotonic()
    t = arrivals.expovariate(rate)
    while t < duration_s:
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        tasks.append(asyncio.create_task(client.send(questions.next(docs), client.now(), records)))
        t += arrivals.expovariate(rate)
    await asyncio.gather(*tasks)
    return records


async def _closed_loop(
    client: OpenAIClient, docs: list[list[int]], questions: _Questions, opts: ServeOptions
) -> list[CallRecord]:
    records: list[CallRecord] = []
    end = time.monotonic() + opts.duration_s

    async def worker() -> None:
        while time.monotonic() < end:
            await client.send(questions.next(docs), client.now(), records)

    await asyncio.gather(*(worker() for _ in range(opts.clients)))
    return records

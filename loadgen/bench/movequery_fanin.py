"""Agentic fan-in of `kvpath bench movequery --fanin`: one holder, sub-agents on other engines.

Per primitive (`route`, `fetch`, `local`, `auto`: the router's `--move-query` mode) a fresh cluster of real
processes: nats-server, index, storage, engine-0 (the holder: `--hold-bytes`; it persists its KV, so the
document can be fetched), then `--engines` requester engines and the router. The document is prefilled once
on engine-0 alone (it pins it and the store keeps it); then, for each N, N sub-agents (the document + their
own suffix of 64-512 tokens) stream at once. Per row: TTFT p50, decode tokens/s (median over the sub-agents
of each one's tokens after its first over the time they took) and the KV bytes the
sub-agents keep resident on the requesters (document + suffix + output per fetched or recomputed request,
suffix + output per routed one: the router's choices counted from its metrics; a routed one that fell back,
counted from the requesters' metrics, keeps a private copy of the document too), and how many sub-agents
were served at once (`peak_concurrent`: most streams between their first and last token at one time) and
how long the whole fan-in took (`makespan_s`).

Memory-bound (`kv_blocks` > 0): each requester's cache is `kv_blocks` blocks (`--num-kv-blocks`), so it can
keep only a few private copies of the document (fetch, local) while routed sub-agents keep only their own
tokens; the holder's cache is the document plus a few blocks (it serves routes, not sub-agents), the same
for every primitive.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.bench.scrape import scrape
from services.up.process import ServiceStack
from services.up.topology import engine_threads, host_cores
from shared.bus import Bus, Registry
from shared.hashing import block_hashes
from shared.kvclient import IndexClient
from shared.natsserver import NatsServer
from shared.protocol import ServiceInfo

BLOCK = 64
READY_TIMEOUT_S = 120.0
HOLDER_SLACK_BLOCKS = 4  # memory-bound holder: room to prefill the document once, never a sub-agent


def _engine_args(
    *, holds: bool, doc_tokens: int, kv_blocks: int = 0, threads: int = 0, model: str = "tiny"
) -> list[str]:
    args = ["--model", model, "--move-query", "--kv-backends", "shm", "--route-timeout-s", "5"]
    if threads > 0:
        args += ["--num-threads", str(threads)]
    if holds:
        if kv_blocks > 0:
            args += ["--num-kv-blocks", str(-(-doc_tokens // BLOCK) + HOLDER_SLACK_BLOCKS)]
        return [*args, "--hold-bytes", str(256 << 20), "--hold-min-tokens", str(doc_tokens)]
    if kv_blocks > 0:
        args += ["--num-kv-blocks", str(kv_blocks)]
    return [*args, "--no-persist-kv"]


async def _until(check: Any, what: str, timeout_s: float = READY_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"fan-in bench: {what} not within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


async def _until_held(bus: Bus, doc: list[int], fingerprint: str) -> None:
    """Until the index lists the document as held by engine-0 (its KV events applied): a sub-agent planned
    before that sees no held chunk, and is served as a plain request whatever the primitive."""
    hashes = block_hashes(doc, BLOCK, fingerprint)
    index = IndexClient(bus)

    async def held() -> bool:
        match = await index.match(hashes, timeout_s=5.0)
        return match.per_location.get("held:engine-0", 0) >= len(hashes)

    await _until(held, "the held document in the index")


async def _ready(stack: ServiceStack, registry: Registry[ServiceInfo], num_engines: int) -> dict[str, Any]:
    """The registry's ready services once the router sees `num_engines` engines."""

    async def ready() -> dict[str, Any] | None:
        for p in stack.procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.service_id} exited: {p.log()}")
        services = {s.service_id: s for s in await registry.list() if s.status == "ready"}
        router = services.get("router-0")
        if router is None:
            return None
        try:
            async with aiohttp.ClientSession() as http, http.get(f"{router.http_url}/health") as resp:
                seen = resp.status == 200 and (await resp.json())["engines"] >= num_engines
        except aiohttp.ClientError:
            return None
        return services if seen else None

    return dict(await _until(ready, f"router seeing {num_engines} engines"))


async def _stream(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, model: str
) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"temperature": 0, "stream": True}
    started, stamps = time.perf_counter(), []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"fan-in request failed: {resp.status} {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return {
        "ttft_s": stamps[0] - started,
        "start": started,
        "first": stamps[0],
        "last": stamps[-1],
        "tokens": len(stamps),
    }


def peak_concurrent(spans: list[tuple[float, float]]) -> int:
    """Most (first token, last token) spans open at one time."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], -e[1]))
    peak = open_now = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    return peak


async def _choices(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return await _counter(http, url, "kvpath_router_movequery_choices_total", "primitive")


async def _fallbacks(http: aiohttp.ClientSession, urls: list[str]) -> float:
    """Routed requests that fell back on the requesters, for any reason (repriced, failed, deadline...)."""
    counts = [await _counter(http, u, "kvpath_engine_route_fallbacks_total", "reason") for u in urls]
    return sum(sum(c.values()) for c in counts)


async def _finished(http: aiohttp.ClientSession, url: str) -> float:
    """Requests an engine finished (any reason)."""
    return sum((await _counter(http, url, "kvpath_engine_requests_finished_total", "reason")).values())


async def _counter(http: aiohttp.ClientSession, url: str, name: str, label: str) -> dict[str, float]:
    """A labelled counter of one service's `/metrics`: label value -> count."""
    samples = await scrape(http, url)
    out = {}
    for (sample, labels), value in samples.items():
        key = dict(labels).get(label)
        if sample == name and key is not None:
            out[key] = value
    return out


async def _one_primitive(primitive: str, opts: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    rng = random.Random(16)
    doc = [rng.randrange(3, 250) for _ in range(opts["doc_tokens"])]
    with NatsServer(store_dir=str(tmp / "nats")) as nats:
        namespace = f"mq{primitive}{rng.randrange(1 << 20)}"
        stack = ServiceStack(tmp, nats, namespace)
        bus = Bus(nats.url, namespace, name="bench")
        try:
            await bus.connect()
            registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
            await registry.open()
            stack.start("index", "index-0")
            stack.start("storage", "storage-0", "--root", str(tmp / "store"))
            kv_blocks, model = opts.get("kv_blocks", 0), opts.get("model", "tiny")
            shape = {
                "model": model,
                "doc_tokens": len(doc),
                "kv_blocks": kv_blocks,
                "threads": engine_threads(opts["engines"] + 1, host_cores()),
            }
            stack.start("engine", "engine-0", *_engine_args(holds=True, **shape))
            router_args = ["--http-port", "0", "--model", model, "--move-query", primitive]
            router_args += ["--movequery-fabric", "shm"]
            if opts.get("profile"):  # the profile the microbenchmark just calibrated
                router_args += ["--movequery-profile", opts["profile"]]
            stack.start("router", "router-0", *router_args)
            ready = await _ready(stack, registry, 1)
            url, kv_format = ready["router-0"].http_url, ready["engine-0"].kv_format
            opts = {**opts, "kv_bytes_per_token": kv_format.bytes_per_token}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
                await _stream(http, url, doc, 2, model)  # prefilled once, pinned, persisted
                await _until_held(bus, doc, kv_format.fingerprint)  # else the first N sees no holder
                for i in range(opts["engines"]):
                    args = _engine_args(holds=False, **shape)
                    stack.start("engine", f"engine-{i + 1}", *args)
                ready = await _ready(stack, registry, opts["engines"] + 1)
                requesters = [ready[f"engine-{i + 1}"].http_url for i in range(opts["engines"])]
                opts = {**opts, "requester_urls": requesters, "holder_url": ready["engine-0"].http_url}
                return [await _fan_in(http, url, doc, n, primitive, opts, rng) for n in opts["ns"]]
        finally:
            await bus.close()
            stack.stop()


async def _fan_in(
    http: aiohttp.ClientSession,
    url: str,
    doc: list[int],
    n: int,
    primitive: str,
    opts: dict[str, Any],
    rng: random.Random,
) -> dict[str, Any]:
    suffixes = [[rng.randrange(3, 250) for _ in range(rng.randrange(64, 513))] for _ in range(n)]
    before, fell_before = await _choices(http, url), await _fallbacks(http, opts["requester_urls"])
    held_before = await _finished(http, opts["holder_url"])
    streams = (_stream(http, url, doc + s, opts["max_tokens"], opts.get("model", "tiny")) for s in suffixes)
    runs = await asyncio.gather(*streams)
    after, fell_after = await _choices(http, url), await _fallbacks(http, opts["requester_urls"])
    on_holder = await _finished(http, opts["holder_url"]) - held_before  # auto may serve some there
    routed = after.get("route", 0.0) - before.get("route", 0.0)
    rates = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in runs if r["last"] > r["first"]]
    fell_back = fell_after - fell_before  # each keeps a private copy of the document from then on
    copies = n - routed + fell_back - on_holder  # private copies: the holder's sub-agents read its own
    resident = sum(len(s) + opts["max_tokens"] for s in suffixes) + copies * len(doc)
    return {
        "n": n,
        "primitive": primitive,
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in runs),
        "decode_tok_s": statistics.median(rates) if rates else 0.0,
        "kv_bytes": int(resident * opts["kv_bytes_per_token"]),
        "routed": int(routed),
        "fell_back": int(fell_back),
        "on_holder": int(on_holder),
        "peak_concurrent": peak_concurrent([(r["first"], r["last"]) for r in runs]),
        "makespan_s": max(r["last"] for r in runs) - min(r["start"] for r in runs),
        "kv_blocks": opts.get("kv_blocks", 0),
    }


def run_fanin(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """A row {n, primitive, ttft_p50_s, decode_tok_s, kv_bytes, routed, fell_back, ...} per primitive, N."""
    rows = []
    for primitive in opts["primitives"]:
        with tempfile.TemporaryDirectory(prefix=f"kvpath-mq-{primitive}-") as tmp:
            rows += asyncio.run(_one_primitive(primitive, opts, Path(tmp)))
    return rows


def format_fanin(rows: list[dict[str, Any]]) -> str:
    lines = [
        "fan-in: one holder, N sub-agents on other engines (kv blocks: per requester, 0 = default cache)",
        "kv blocks   N  primitive  TTFT p50 ms  decode tok/s  KV MB  routed  fell back  on holder  at once"
        "  makespan s",
    ]
    for r in rows:
        lines.append(
            f"{r.get('kv_blocks', 0):>9}{r['n']:>4}  {r['primitive']:<9}{r['ttft_p50_s'] * 1e3:>12.1f}"
            f"{r['decode_tok_s']:>14.1f}{r['kv_bytes'] / 1e6:>7.1f}{r.get('routed', 0):>8}"
            f"{r.get('fell_back', 0):>11}{r.get('on_holder', 0):>11}{r.get('peak_concurrent', 0):>9}"
            f"{r.get('makespan_s', 0.0):>12.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # manual runs: python -m loadgen.bench.movequery_fanin
    opts = {"primitives": ["route"], "ns": [4], "engines": 2, "doc_tokens": 1024, "max_tokens": 16}
    print(json.dumps(run_fanin(opts), indent=2))

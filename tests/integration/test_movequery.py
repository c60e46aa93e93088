"""Move the query, not the cache, through the whole stack: agentic fan-in on real processes (nats-server,
index, router and three colocated engines on the tiny model, KV data plane over shm or tcp).

A document is prefilled once on engine-0, which pins it as a held chunk (`held:engine-0` in the index).
Sub-agents (the document + their own suffix) then go to engine-1 and engine-2 (the router's `route` mode
keeps the holder free), which route every layer's query rows to engine-0 and merge its partials: their
greedy tokens equal those of the same prompts served with the document in the cache, and their caches never
hold the document. Killing the holder in the middle of a routed decode makes the requester recompute the
chunk locally and finish with the same tokens."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shared.bus import Bus
from shared.errors import InvalidRequestError
from shared.hashing import block_hashes
from shared.kvclient import IndexClient
from shared.protocol import LoadReport
from shared.protocol.movequery import RouteBuffer, RouteOpen, RouteOpened
from tests.cluster import Stack, wait_ready
from tests.integration.test_kv_reuse import complete
from tests.integration.test_remote_tier import counter, engine_metrics

pytestmark = pytest.mark.slow
BLOCK, DOC_TOKENS = 64, 256


def engine_args(backend: str, *, holds: bool) -> tuple[str, ...]:
    args = ("--move-query", "--no-persist-kv", "--no-load-kv", "--kv-backends", backend)
    args += ("--route-timeout-s", "2", "--route-region-bytes", str(8 << 20))
    if holds:
        args += ("--hold-bytes", str(32 << 20), "--hold-min-tokens", str(DOC_TOKENS))
    return args


def bad_open(chunk_hash: int, num_blocks: int, fingerprint: str, query_bytes: int) -> RouteOpen:
    reply = RouteBuffer(engine_id="x", endpoint={}, region="r", offset=0, size_bytes=1 << 20, slot=1)
    return RouteOpen(
        request_id="bad",
        chunk_hash=chunk_hash,
        num_blocks=num_blocks,
        fingerprint=fingerprint,
        query_bytes_per_token=query_bytes,
        max_query_tokens=8,
        reply=reply,
        sender_id="x",
        deadline_unix_s=time.time() + 5,
    )


def tokens(out: dict[str, Any]) -> list[int]:
    return list(out["choices"][0]["token_ids"])


async def until_held(bus: Bus, doc: list[int], fingerprint: str, timeout_s: float = 30) -> None:
    """The index knows engine-0 holds the document (its KV events applied)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    hashes = block_hashes(doc, BLOCK, fingerprint)
    while (await IndexClient(bus).match(hashes)).per_location.get("held:engine-0", 0) < len(hashes):
        assert asyncio.get_running_loop().time() < deadline, "the held chunk never reached the index"
        await asyncio.sleep(0.05)


def stream_until_first_token(
    http: aiohttp.ClientSession, url: str, prompt: list[int], n: int
) -> tuple[asyncio.Task[list[int]], asyncio.Event]:
    """A streamed completion; the event is set once its first token arrived, the task ends with all ids."""
    first = asyncio.Event()

    async def run() -> list[int]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": n,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
            "stream": True,
        }
        ids: list[int] = []
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text[6:])
                ids += chunk["choices"][0].get("token_ids") or []
                if ids:
                    first.set()
        return ids

    return asyncio.create_task(run()), first


@pytest.mark.parametrize("backend", ["shm", "tcp"])
async def test_fan_in_routes_to_the_holder_with_identical_tokens_and_survives_its_death(
    stack: tuple[Stack, Bus], backend: str
) -> None:
    s, bus = stack
    rng = random.Random(16)
    doc = [rng.randrange(3, 250) for _ in range(DOC_TOKENS)]
    agents = [doc + [rng.randrange(3, 250) for _ in range(n)] for n in (40, 75, 90, 120)]
    s.start("index", "index-0")
    holder = s.start("engine", "engine-0", *engine_args(backend, holds=True))
    s.start("router", "router-0", "--http-port", "0", "--move-query", "route")
    ready = await wait_ready(bus, {"index-0", "engine-0", "router-0"}, s.procs)
    url = ready["router-0"].http_url
    fingerprint = ready["engine-0"].kv_format.fingerprint
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        # the document is prefilled once and pinned; the baseline: every agent with the document cached
        await complete(http, url, doc, 4, "doc")
        await until_held(bus, doc, fingerprint)
        want = [tokens(await complete(http, url, p, 24, f"b{i}")) for i, p in enumerate(agents)]
        long_want = [tokens(await complete(http, url, p, 160, f"long{i}")) for i, p in enumerate(agents[:3])]

        others = [s.start("engine", f"engine-{i}", *engine_args(backend, holds=False)) for i in (1, 2)]
        ids = {"engine-0", "engine-1", "engine-2", "router-0"}
        ready = await wait_ready(bus, ids, s.procs, num_engines=3)
        measured = asyncio.Event()  # a requester reports its routed steps' waits for partials

        async def on_report(report: LoadReport, _: Any) -> None:
            if report.route is not None and report.route.route_step_s > 0:
                measured.set()

        for engine_id in ("engine-1", "engine-2"):
            await bus.subscribe(bus.subjects.load("colocated", engine_id), LoadReport, on_report)
        outs = await asyncio.gather(*(complete(http, url, p, 24, f"a{i}") for i, p in enumerate(agents)))
        assert [tokens(o) for o in outs] == want
        await asyncio.wait_for(measured.wait(), 10)
        routed = exchanges = carried = 0.0
        for engine_id in ("engine-1", "engine-2"):
            text = await engine_metrics(http, ready[engine_id].http_url)
            routed += counter(text, "kvpath_engine_route_requests_total", primitive="route")
            assert "kvpath_engine_route_fallbacks_total{" not in text  # none fell back, for any reason
            exchanges += counter(text, "kvpath_engine_route_exchange_size_count")
            carried += counter(text, "kvpath_engine_route_exchange_size_sum")
        assert routed == len(agents)  # each agent's document attended on the holder
        assert carried > exchanges > 0  # agents in one forward shared their round trips to the holder
        text = await engine_metrics(http, ready["engine-0"].http_url)
        assert counter(text, "kvpath_engine_holder_query_tokens_total") > 0
        assert counter(text, "kvpath_engine_holder_sessions_total", outcome="opened") == len(agents)

        # malformed route opens are answered with an error at once (unknown chunk, wrong query shape)
        hashes = block_hashes(doc, BLOCK, fingerprint)
        for chunk_hash, query_bytes, error in ((12345, 0, "holds no chunk"), (hashes[-1], 1, "query bytes")):
            bad = bad_open(chunk_hash, len(hashes), fingerprint, query_bytes)
            with pytest.raises(InvalidRequestError, match=error):
                await bus.request(bus.subjects.route("engine-0"), bad, RouteOpened, timeout_s=5)

        # the holder dies while three routed requests decode (two of them share one requester, so their
        # round trips are one group): each recomputes the document and finishes the same
        streams = [stream_until_first_token(http, url, p, 160) for p in agents[:3]]
        await asyncio.wait_for(asyncio.gather(*(first.wait() for _, first in streams)), 60)
        holder.kill()
        assert await asyncio.wait_for(asyncio.gather(*(task for task, _ in streams)), 120) == long_want
        fallbacks = 0.0
        for engine_id in ("engine-1", "engine-2"):
            text = await engine_metrics(http, ready[engine_id].http_url)
            fallbacks += counter(text, "kvpath_engine_route_requests_total", primitive="fallback_local")
        assert fallbacks == 3
        assert all(p.proc.poll() is None for p in others)


async def named_chunks(http: aiohttp.ClientSession, url: str, key: str) -> list[dict[str, Any]]:
    async with http.get(f"{url}/v1/kv_chunks", headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        assert body["object"] == "list" and body["unreachable"] == []
        return list(body["data"])


async def test_a_named_chunk_is_pinned_listed_per_tenant_routed_to_and_deleted(
    stack: tuple[Stack, Bus], tmp_path: Any
) -> None:
    """`kv_chunk`: a prompt kept under a client's name on the holder even below `--hold-min-tokens`, listed
    to its tenant only, routed to by another engine's requests with the tokens of a cached prefix, and
    deleted (404 for another tenant, freed for the owner); a router without --move-query refuses the field."""
    s, bus = stack
    alice, bob = "sk-alice-0123456789", "sk-bob-00123456789"
    (tmp_path / "keys").write_text(f"{alice} alice\n{bob} bob\n")
    rng = random.Random(7)
    doc = [rng.randrange(3, 250) for _ in range(DOC_TOKENS)]
    agent = doc + [rng.randrange(3, 250) for _ in range(50)]
    s.start("index", "index-0")
    holder_args = (*engine_args("shm", holds=True)[:-1], str(1 << 20))  # only named chunks are held
    s.start("engine", "engine-0", *holder_args)
    keys = ("--api-key-file", str(tmp_path / "keys"))
    s.start("router", "router-0", "--http-port", "0", "--move-query", "route", *keys)
    s.start("router", "router-1", "--http-port", "0", *keys)
    ready = await wait_ready(bus, {"index-0", "engine-0", "router-0", "router-1"}, s.procs)
    url, plain_url = ready["router-0"].http_url, ready["router-1"].http_url
    auth = {"Authorization": f"Bearer {alice}"}

    async def post(u: str, prompt: list[int], key: str = alice, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        body |= {"return_token_ids": True, **extra}
        headers = {"Authorization": f"Bearer {key}"}
        async with http.post(f"{u}/v1/completions", json=body, headers=headers) as resp:
            return resp.status, dict(await resp.json())

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for u, name, error in ((url, "a b", "128 letters"), (plain_url, "repo", "--move-query")):
            status, out = await post(u, doc, kv_chunk=name)
            assert status == 400 and error in out["error"]["message"] and out["error"]["param"] == "kv_chunk"
        status, out = await post(url, agent)  # served with no chunk held anywhere
        assert status == 200, out
        want = tokens(out)
        status, out = await post(url, doc, kv_chunk="repo")
        assert status == 200, out
        deadline = asyncio.get_running_loop().time() + 30
        while not (listed := await named_chunks(http, url, alice)):  # pinned when the request finished
            assert asyncio.get_running_loop().time() < deadline, "the named chunk was never listed"
            await asyncio.sleep(0.05)
        assert [(c["id"], c["holder"], c["tokens"]) for c in listed] == [("repo", "engine-0", DOC_TOKENS)]
        assert await named_chunks(http, url, bob) == []

        s.start("engine", "engine-1", *engine_args("shm", holds=False))
        ready = await wait_ready(bus, {"engine-0", "engine-1", "router-0"}, s.procs, num_engines=2)
        status, out = await post(url, agent)
        assert status == 200 and tokens(out) == want  # on engine-1, the document routed
        text = await engine_metrics(http, ready["engine-1"].http_url)
        assert counter(text, "kvpath_engine_route_requests_total", primitive="route") == 1
        text = await engine_metrics(http, ready["engine-0"].http_url)
        assert counter(text, "kvpath_engine_held_pins_total", outcome="new") == 1

        async with http.delete(
            f"{url}/v1/kv_chunks/repo", headers={"Authorization": f"Bearer {bob}"}
        ) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
        async with http.delete(f"{url}/v1/kv_chunks/repo", headers=auth) as resp:
            assert resp.status == 200 and (await resp.json())["deleted"] is True
        assert await named_chunks(http, url, alice) == []
        async with http.delete(f"{url}/v1/kv_chunks/repo", headers=auth) as resp:
            assert resp.status == 404


async def test_a_routed_request_on_a_pool_engine_keeps_the_held_chunk_out_of_the_pool(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    """Move the query beside Beluga's pool: a requester that maps the pool routes its document to the
    holder (which does not map it), with the holder's tokens; it writes only its own blocks into the pool,
    never the chunk's positions (which its cache never held); and once the holder is dead the next request
    on the same document recomputes it, with the same tokens, instead of reading anything of it back."""
    s, bus = stack
    rng = random.Random(17)
    doc = [rng.randrange(3, 250) for _ in range(DOC_TOKENS)]
    agents = [doc + [rng.randrange(3, 250) for _ in range(n)] for n in (130, 200)]
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    s.start("cxlpool", "pool-0", "--model", "tiny", "--capacity-bytes", str(32 << 20))
    holder = s.start("engine", "engine-0", *engine_args("shm", holds=True))
    s.start("router", "router-0", "--http-port", "0", "--move-query", "route")
    ready = await wait_ready(bus, {"index-0", "storage-0", "pool-0", "engine-0", "router-0"}, s.procs)
    url = ready["router-0"].http_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await complete(http, url, doc, 4, "doc")
        await until_held(bus, doc, ready["engine-0"].kv_format.fingerprint)
        want = [tokens(await complete(http, url, p, 16, f"b{i}")) for i, p in enumerate(agents)]
        route = ("--move-query", "--kv-backends", "shm", "--route-timeout-s", "2")
        s.start("engine", "engine-1", *route, "--route-region-bytes", str(8 << 20), "--kv-pool", "pool-0")
        ready = await wait_ready(bus, {"engine-0", "engine-1", "router-0"}, s.procs, num_engines=2)
        outs = [await complete(http, url, p, 16, f"a{i}") for i, p in enumerate(agents)]
        assert [tokens(o) for o in outs] == want
        text = await engine_metrics(http, ready["engine-1"].http_url)
        assert counter(text, "kvpath_engine_route_requests_total", primitive="route") == len(agents)
        own = sum((len(p) + 16 - 1) // BLOCK - DOC_TOKENS // BLOCK for p in agents)  # full, past the doc
        written = counter(text, "kvpath_engine_kv_pool_blocks_total", outcome="written")
        assert 0 < written <= own, (written, own)
        holder.kill()
        out = await complete(http, url, agents[0], 16, "after")
        assert tokens(out) == want[0]
        text = await engine_metrics(http, ready["engine-1"].http_url)
        assert counter(text, "kvpath_engine_kv_pool_blocks_total", outcome="hit") == 0


async def held_by(bus: Bus, doc: list[int], fingerprint: str, timeout_s: float = 30) -> str:
    """The engine the index lists as holding the whole document (waits for its KV events)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    hashes = block_hashes(doc, BLOCK, fingerprint)
    while True:
        per_location = (await IndexClient(bus).match(hashes)).per_location
        held = [loc for loc, n in per_location.items() if loc.startswith("held:") and n >= len(hashes)]
        if held:
            return held[0].removeprefix("held:")
        assert asyncio.get_running_loop().time() < deadline, "no engine's held chunk reached the index"
        await asyncio.sleep(0.05)


async def test_two_holders_routing_to_each_other_at_once_do_not_wait_on_each_other(
    stack: tuple[Stack, Bus],
) -> None:
    """Two engines each hold a document and each decodes sub-agents of the other's document at the same
    time. A routed forward blocks its model thread until the holder's partials come back, and the holder's
    attention runs on its own model thread: each forward would wait for the other until the exchange's
    deadline (2 s here), then fall back, every step. The blocked forward now runs the partial attention
    queued for it meanwhile: no request falls back, the tokens are those of the sub-agents run one by one."""
    s, bus = stack
    rng = random.Random(7)
    docs = [[rng.randrange(3, 250) for _ in range(DOC_TOKENS)] for _ in range(2)]
    agents = [doc + [rng.randrange(3, 250) for _ in range(30 + 20 * i)] for doc in docs for i in range(2)]
    s.start("index", "index-0")
    engines = ("engine-0", "engine-1")
    for engine_id in engines:
        s.start("engine", engine_id, *engine_args("shm", holds=True))
    s.start("router", "router-0", "--http-port", "0", "--move-query", "route")
    ready = await wait_ready(bus, {"index-0", "router-0", *engines}, s.procs, num_engines=2)
    url = ready["router-0"].http_url
    fingerprint = ready["engine-0"].kv_format.fingerprint
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(complete(http, url, doc, 4, f"doc{i}") for i, doc in enumerate(docs)))
        holders = [await held_by(bus, doc, fingerprint) for doc in docs]
        assert sorted(holders) == sorted(engines)  # a burst is spread: one document on each engine
        want = [tokens(await complete(http, url, p, 24, f"one{i}")) for i, p in enumerate(agents)]
        outs = await asyncio.gather(*(complete(http, url, p, 24, f"all{i}") for i, p in enumerate(agents)))
        assert [tokens(o) for o in outs] == want
        routed = 0.0
        for engine_id in engines:
            text = await engine_metrics(http, ready[engine_id].http_url)
            assert "kvpath_engine_route_fallbacks_total{" not in text  # none waited out its deadline
            routed += counter(text, "kvpath_engine_route_requests_total", primitive="route")
    assert routed == 2 * len(agents)  # run one by one, then all at once: every one routed

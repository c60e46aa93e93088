"""Observability of a real cluster (`kvpath up`: every service its own process, a real nats-server).

Each process exports its finished spans to `$KVPATH_TRACE_DIR/<service>-<pid>.jsonl` (the test-only span-file
exporter of shared.telemetry) and logs JSON lines at DEBUG; the tests read the union of the span files, scrape
every service's /metrics and read the service logs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import telemetry
from tests.cluster import UpProcess
from tests.unit.test_telemetry_metrics import documented_metrics

pytestmark = pytest.mark.slow

PROMPT = list(range(3, 203))  # 200 tokens: 3 full blocks of 64 can be stored and hit
SERVICES = {"kvpath-router", "kvpath-engine", "kvpath-storage", "kvpath-index"}


@dataclass(slots=True)
class Observed:
    up: UpProcess
    trace_dir: Path
    log_dir: Path

    @property
    def url(self) -> str:
        return self.up.url


def observed_cluster(tmp: Path, *args: str) -> Iterator[Observed]:
    trace_dir = tmp / "traces"
    with pytest.MonkeyPatch.context() as env:  # `kvpath up` and its services inherit these
        env.setenv(telemetry.TRACE_DIR_ENV, str(trace_dir))
        env.setenv("KVPATH_LOG_JSON", "1")
        env.setenv("KVPATH_LOG_LEVEL", "DEBUG")
        up = UpProcess(tmp, *args)
    yield Observed(up, trace_dir, Path(up.info["log_dir"]))
    assert up.stop() == 0, up.log()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    yield from observed_cluster(tmp_path_factory.mktemp("obs"))


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], session: str) -> str:
    """A streamed completion; returns its request id (the `id` of the chunks)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}
    request_id = ""
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-Id": session}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                assert "error" not in chunk, chunk
                request_id = request_id or chunk["id"]
    assert request_id
    return request_id


async def request_trace(trace_dir: Path, request_id: str, names: set[str]) -> list[dict[str, Any]]:
    """The spans of the request's trace, once every name in `names` has been exported (or the deadline)."""
    deadline = time.monotonic() + 30
    while True:
        spans = telemetry.read_span_files(trace_dir)
        roots = [
            s for s in spans if s["kind"] == "SERVER" and s["attributes"].get("request_id") == request_id
        ]
        if roots:
            got = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
            if names <= {s["name"] for s in got}:
                # one request, one trace: every span naming the request is in it
                tagged = {s["trace_id"] for s in spans if s["attributes"].get("request_id") == request_id}
                assert tagged == {roots[0]["trace_id"]}, tagged
                return got
        assert time.monotonic() < deadline, sorted({s["name"] for s in spans})
        await asyncio.sleep(0.1)


def check_tree(trace: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One root (the router's HTTP span); every other span's parent is in the trace. Returns id -> span."""
    by_id = {s["span_id"]: s for s in trace}
    roots = [s for s in trace if not s["parent_id"]]
    assert [(r["service"], r["kind"]) for r in roots] == [("kvpath-router", "SERVER")], roots
    orphans = [s["name"] for s in trace if s["parent_id"] and s["parent_id"] not in by_id]
    assert orphans == []
    return by_id


def first(trace: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(s for s in trace if s["name"] == name)


async def test_one_request_is_one_trace_from_router_through_engine_and_storage(
    colocated: Observed, http: aiohttp.ClientSession
) -> None:
    trace_dir = colocated.trace_dir
    cold = await complete(http, colocated.url, PROMPT, "obs-1")
    hit = await complete(http, colocated.url, PROMPT, "obs-1")  # the stored prefix is read back

    trace = await request_trace(
        trace_dir,
        hit,
        {"POST /v1/completions", "index.lookup", "index.match", "schedule", "kv.load", "storage.read"}
        | {"prefill", "decode", "stream"},
    )
    by_id = check_tree(trace)
    assert {s["service"] for s in trace} == SERVICES
    http_span = first(trace, "POST /v1/completions")
    read, load = first(trace, "storage.read"), first(trace, "kv.load")
    assert by_id[read["parent_id"]] is load and load["parent_id"] == http_span["span_id"]
    assert read["attributes"]["num_blocks"] == 3 and read["attributes"]["bytes"] > 0
    assert by_id[first(trace, "index.match")["parent_id"]]["name"] == "index.lookup"
    prefill, decode = first(trace, "prefill"), first(trace, "decode")
    assert prefill["attributes"]["cached_tokens"] == 192 and prefill["parent_id"] == http_span["span_id"]
    assert prefill["end_ns"] <= decode["start_ns"] and decode["attributes"]["output_tokens"] == 4
    assert [e["name"] for e in prefill["events"]] == ["chunk"]
    stream = first(trace, "stream")
    assert http_span["start_ns"] <= stream["start_ns"] <= stream["end_ns"] <= http_span["end_ns"]
    assert first(trace, "schedule")["attributes"]["engine_id"].startswith("engine")

    # the cold request persisted its blocks: the storage writes belong to its trace
    cold_trace = await request_trace(trace_dir, cold, {"storage.write", "prefill", "decode"})
    check_tree(cold_trace)
    write = first(cold_trace, "storage.write")
    assert write["service"] == "kvpath-storage" and write["attributes"]["num_blocks"] == 3


async def test_metrics_of_every_service_parse_and_carry_the_documented_names(
    colocated: Observed, http: aiohttp.ClientSession
) -> None:
    documented = documented_metrics()
    kinds = {"router": "router", "index": "index", "storage": "storage", "engine": "engine"}
    seen = set()
    for name, url in colocated.up.services.items():
        kind = next(k for prefix, k in kinds.items() if name.startswith(prefix))
        async with http.get(f"{url}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        exposed = set()
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # creation times of counters and histograms
                base = family.name.removesuffix("_created")
                assert {base, base + "_total"} & documented.keys(), family.name
                continue
            scraped = family.name + ("_total" if family.type == "counter" else "")
            exposed.add(scraped)
            if family.name.startswith("kvpath_"):
                doc = documented.get(scraped)
                assert doc is not None and doc.type == family.type, f"{name}: {scraped} undocumented"
        own = (kind, "bus", "process")
        expected = {m for m, d in documented.items() if d.section in own}
        assert sorted(expected - exposed) == [], name
        # only its own: services forked by `kvpath up` inherit every service's (zero) metrics otherwise
        foreign = {m for m in exposed if m in documented and documented[m].section not in own}
        assert not foreign, (name, sorted(foreign))
        seen.add(kind)
    assert seen == set(kinds.values())
    # scrapes and health probes (wait_ready polls /health) make no traces
    paths = {s["attributes"].get("url.path") for s in telemetry.read_span_files(colocated.trace_dir)}
    assert not paths & {"/health", "/metrics"}, paths


async def test_every_service_froze_its_startup_heap(colocated: Observed, http: aiohttp.ClientSession) -> None:
    """`kvpath serve` starts a service with the collector off and, once it is ready, freezes what startup
    made (an engine's ~200k objects, a router's ~60k), then turns the collector on (test_service_gc.py)."""
    for name, url in colocated.up.services.items():
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        frozen = [
            family.samples[0].value
            for family in text_string_to_metric_families(text)
            if family.name == "kvpath_process_gc_frozen_objects"
        ]
        assert frozen and frozen[0] > 10_000, (name, frozen)


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes().splitlines():
        if line.startswith(b"{"):
            out.append(orjson.loads(line))
    return out


async def test_json_log_lines_about_a_request_carry_its_id(
    colocated: Observed, http: aiohttp.ClientSession
) -> None:
    request_id = await complete(http, colocated.url, PROMPT[:150], "obs-logs")
    log_dir = colocated.log_dir
    wanted = {"router-0", "storage-0", next(n for n in colocated.up.services if n.startswith("engine"))}
    deadline = time.monotonic() + 30
    while True:  # the engine logs the request's end after its last token went out
        lines = {name: json_lines(log_dir / f"{name}.log") for name in wanted}
        tagged = {name: [x for x in got if x.get("request_id") == request_id] for name, got in lines.items()}
        if all(tagged.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert {name for name, got in tagged.items() if got} == wanted, {n: len(v) for n, v in lines.items()}
    assert any(
        x["msg"].startswith("request finished")
        for x in tagged[next(iter(wanted - {"router-0", "storage-0"}))]
    )
    for name, got in lines.items():
        about = [x for x in got if f"request_id={request_id}" in x["msg"]]
        assert about and all(x.get("request_id") == request_id for x in about), name
        assert all(x["service"] in ("router", "engine", "storage") for x in got)


# ------------------------------------------------------------------------------------------- DualPath


@pytest.fixture(scope="module")
def dualpath(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    # round-robin read sides: turn 2 reads on the PE's node, turn 3 on the DE's node (streamed DE -> PE)
    args = ("--prefill-nodes", "1", "--decode-nodes", "1", "--policy", "dualpath-rr")
    yield from observed_cluster(tmp_path_factory.mktemp("obs-pd"), *args)


async def test_dualpath_trace_covers_both_engines_and_the_kv_transfers(
    dualpath: Observed, http: aiohttp.ClientSession
) -> None:
    trace_dir = dualpath.trace_dir
    turn1 = await complete(http, dualpath.url, PROMPT, "pd")
    turn2 = await complete(http, dualpath.url, PROMPT + list(range(5, 80)), "pd")  # read on the PE node
    turn3 = await complete(http, dualpath.url, PROMPT + list(range(5, 150)), "pd")  # read on the DE node

    common = {"schedule", "prefill", "decode", "kv.receive", "kv.transfer", "stream"}
    first_trace = await request_trace(trace_dir, turn1, common)
    check_tree(first_trace)
    schedule = first(first_trace, "schedule")["attributes"]
    assert schedule["pe_id"].startswith("pe") and schedule["de_id"].startswith("de")
    sent = first(first_trace, "kv.transfer")["attributes"]
    assert sent["path"] == "pe_to_de" and sent["bytes"] > 0 and sent["peer"] == schedule["de_id"]
    engines = {s["instance"] for s in first_trace if s["service"] == "kvpath-engine"}
    assert len(engines) == 2  # the prefill engine and the decode engine

    pe_read = await request_trace(trace_dir, turn2, common | {"kv.load", "storage.read"})
    check_tree(pe_read)
    assert first(pe_read, "schedule")["attributes"]["read_side"] == "pe"

    de_read = await request_trace(trace_dir, turn3, common | {"kv.load", "kv.pull", "storage.read"})
    by_id = check_tree(de_read)
    assert first(de_read, "schedule")["attributes"]["read_side"] == "de"
    pulled = next(s for s in de_read if s["name"] == "kv.transfer" and s["attributes"]["path"] == "de_to_pe")
    assert by_id[pulled["parent_id"]]["name"] == "kv.pull"
    assert by_id[first(de_read, "kv.pull")["parent_id"]]["name"] == "kv.load"  # asked by the PE's prefix load
    assert pulled["attributes"]["bytes"] > 0

"""DualPath end to end: prefill and decode engines on two emulated nodes, both read paths, over HTTP."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from gpu.model_spec import load_model_spec
from shared.bus import Bus, Registry
from shared.protocol import ServiceInfo
from tests.cluster import Stack, UpProcess, wait_ready
from tests.integration.test_api import engine_idle, wait_until
from tests.integration.test_kv_reuse import complete, run_session

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["tiny", "tiny-mla"])
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def disagg(tmp_path_factory: pytest.TempPathFactory, model: str) -> Iterator[UpProcess]:
    # round-robin read sides: a session's turn 2 reads on the PE's node, turn 3 on the DE's node
    up = UpProcess(
        tmp_path_factory.mktemp("pd"),
        "--model",
        model,
        "--prefill-nodes",
        "1",
        "--decode-nodes",
        "1",
        "--policy",
        "dualpath-rr",
    )
    yield up
    assert up.stop() == 0, up.log()


@pytest.fixture(scope="module")
def cold(
    cold_cluster: UpProcess, tmp_path_factory: pytest.TempPathFactory, model: str
) -> Iterator[UpProcess]:
    if model == "tiny":  # the shared `kvpath up --no-kv-store` (tests/conftest.py) serves it
        yield cold_cluster
        return
    up = UpProcess(tmp_path_factory.mktemp("cold"), "--model", model, "--no-kv-store")
    yield up
    assert up.stop() == 0, up.log()


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)]
    return sum(values)


async def test_both_read_paths_match_colocated_recompute(
    disagg: UpProcess, cold: UpProcess, model: str, http: aiohttp.ClientSession
) -> None:
    warm = await run_session(http, disagg.url, seed=3, model=model)
    ref = await run_session(http, cold.url, seed=3, model=model)
    for w, r in zip(warm, ref, strict=True):
        assert w["out"]["choices"][0]["token_ids"] == r["out"]["choices"][0]["token_ids"]
    cached = [w["out"]["usage"]["prompt_tokens_details"]["cached_tokens"] for w in warm]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    # turn 2 was read by node 0 (PE path), turn 3 by node 1 (DE path, streamed DE -> PE)
    node_reads = [
        await metric(http, disagg.services[f"storage-{n}"], "kvpath_storage_read_bytes_total") for n in (0, 1)
    ]
    assert node_reads[0] > 0 and node_reads[1] > 0, node_reads
    de_url = next(u for name, u in disagg.services.items() if name.startswith("de"))
    assert await metric(http, de_url, 'kvpath_engine_kv_transfer_bytes_total{path="de_to_pe"}') > 0


def test_topology_has_no_colocated_engine(disagg: UpProcess, tmp_path: Path) -> None:
    names = sorted(disagg.services)
    assert any(n.startswith("pe") for n in names) and any(n.startswith("de") for n in names)
    assert not any(n.startswith("engine") for n in names)


async def test_read_side_node_death_mid_read_is_dispatched_again_and_the_rest_recovers(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    s, bus = stack
    root = str(tmp_path / "store")
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--node", "0", "--root", root)
    # decode nodes read slowly, so one can die in the middle of a read: 6 blocks take 1.6 s at 500 kB/s (the
    # kill lands within ~50 ms of the read starting); the survivor reads them twice more at that rate
    nodes = {}
    for node, de in ((1, "de-a"), (2, "de-b")):
        storage = s.start(
            "storage",
            f"storage-{node}",
            "--node",
            str(node),
            "--root",
            root,
            "--bandwidth-bytes-per-s",
            "500000",
        )
        nodes[node] = (storage, s.start("engine", de, "--role", "decode", "--node", str(node)), de)
    s.start("engine", "pe-0", "--role", "prefill", "--node", "0")
    s.start(
        "router",
        "router-0",
        "--http-port",
        "0",
        "--policy",
        "dualpath",
        "--force-read-side",
        "de",
        "--engine-silence-timeout-s",
        "1.0",
    )
    ids = {"index-0", "storage-0", "storage-1", "storage-2", "pe-0", "de-a", "de-b", "router-0"}
    ready = await wait_ready(bus, ids, s.procs, num_engines=3)
    url = ready["router-0"].http_url
    prompt = [3 + i % 250 for i in range(400)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        first = await complete(http, url, prompt, 4, "n")  # persists the prompt's 6 full blocks
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        body["return_token_ids"] = True
        request = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body))
        node = await reading_node(http, {n: ready[f"storage-{n}"].http_url for n in nodes})
        storage, engine, de = nodes[node]
        storage.kill()  # the read-side node dies mid-read: its storage and its decode engine
        engine.kill()
        resp = await request
        # no token had reached the client: the router sent the request again, to the surviving node
        out = await resp.json()
        assert resp.status == 200, out
        assert out["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        redispatched = 'kvpath_router_requests_redispatched_total{reason="engine_lost"}'
        assert await metric(http, url, redispatched) == 1
        # the surviving engines serve the session on (decode and read on the other node)
        again = await complete(http, url, prompt, 4, "n")
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 384


async def reading_node(http: aiohttp.ClientSession, storage_urls: dict[int, str]) -> int:
    """The node whose storage service has a read in progress (waits for one, with a deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while True:
        for node, url in storage_urls.items():
            if await metric(http, url, "kvpath_storage_read_requests_pending") >= 1:
                return node
        assert loop.time() < deadline, "no storage read started"
        await asyncio.sleep(0.02)


async def test_a_restarted_prefill_engine_serves_its_first_request(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    """A prefill engine that died and came back under its id (as `kvpath up` restarts it) serves the very
    next request: the decode engine waits briefly for the new process to connect instead of failing on the
    old one's gone-state (issue 11: the first request after a restart was a 500)."""
    s, bus = stack
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--node", "0", "--root", str(tmp_path / "store"))
    s.start("engine", "de-0", "--role", "decode", "--node", "0")
    pe = s.start("engine", "pe-0", "--role", "prefill", "--node", "0")
    s.start(
        "router", "router-0", "--http-port", "0", "--policy", "dualpath", "--engine-silence-timeout-s", "1.0"
    )
    ready = await wait_ready(
        bus, {"index-0", "storage-0", "de-0", "pe-0", "router-0"}, s.procs, num_engines=2
    )
    url = ready["router-0"].http_url
    prompt = [3 + i % 250 for i in range(300)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        first = await complete(http, url, prompt, 4, "r")
        pe.kill()

        s.start("engine", "pe-0", "--role", "prefill", "--node", "0")
        await new_incarnation(bus, "pe-0", ready["pe-0"].http_url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while await router_engines(http, url) < 2:  # the router hears the new process's load reports
            assert loop.time() < deadline, "the router never saw pe-0 again"
            await asyncio.sleep(0.05)
        again = await complete(http, url, prompt, 4, "r")
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


async def new_incarnation(bus: Bus, service_id: str, old_url: str) -> None:
    """Until the registry lists a ready `service_id` that is another process than the one at `old_url`."""
    registry: Registry[ServiceInfo] = Registry(bus, ttl_s=5.0)
    await registry.open()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not any(
        i.service_id == service_id and i.status == "ready" and i.http_url != old_url
        for i in await registry.list()
    ):
        assert loop.time() < deadline, f"{service_id} did not come back"
        await asyncio.sleep(0.1)


async def router_engines(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/health") as resp:
        return int((await resp.json())["engines"])


async def test_a_first_token_that_ends_the_request_on_the_pe_ends_it_cleanly(
    disagg: UpProcess, model: str, http: aiohttp.ClientSession
) -> None:
    """EOS as the first token (a logit bias forces it): the PE ends the request and tells the DE so, without
    a token. The DE used to take that DONE for a failed prefill and send the router an error, which raced
    the PE's own "stop": a 502 now and then (the compose test's chat at temperature 1 met it)."""
    de_url = next(u for name, u in disagg.services.items() if name.startswith("de"))
    eos = load_model_spec(model).eos_token_ids[0]
    errors = 'kvpath_engine_requests_finished_total{reason="error"}'
    before = await labelled_metric(http, de_url, errors)
    for i in range(3):
        prompt = f"{uuid.uuid4().hex} ends at once {i}"
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "logit_bias": {str(eos): 100}}
        async with http.post(f"{disagg.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
    assert await labelled_metric(http, de_url, errors) == before  # the DE finished them, not as errors


async def labelled_metric(http: aiohttp.ClientSession, url: str, sample: str) -> float:
    """One labelled sample of a Prometheus family (0 when it has not been counted yet)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    found = re.search(rf"^{re.escape(sample)} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_n_choices_prefill_once_on_the_pe_and_fork_on_the_de(
    disagg: UpProcess, model: str, http: aiohttp.ClientSession
) -> None:
    """n choices: the PE prefills the prompt once, the DE forks it (one recomputed token per extra choice);
    greedy choices are equal, sampled ones differ, and a client going away frees every block of the DE."""
    pe_url = next(u for name, u in disagg.services.items() if name.startswith("pe"))
    de_url = next(u for name, u in disagg.services.items() if name.startswith("de"))
    counter = "kvpath_engine_prefill_tokens_total"

    async def choices(**extra: object) -> tuple[list[list[int]], int, float, float]:
        before = [await metric(http, url, counter) for url in (pe_url, de_url)]
        prompt = f"{uuid.uuid4().hex} a prompt of a few blocks " * 8  # never stored before: no prefix hit
        body = {"model": model, "prompt": prompt, "n": 3, "max_tokens": 8, "return_token_ids": True, **extra}
        async with http.post(f"{disagg.url}/v1/completions", json=body) as resp:
            out = await resp.json()
        after = [await metric(http, url, counter) for url in (pe_url, de_url)]
        ids = [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]
        return ids, len(out["prompt_token_ids"]), after[0] - before[0], after[1] - before[1]

    greedy, num_prompt_tokens, pe_tokens, de_tokens = await choices(temperature=0, ignore_eos=True)
    assert greedy[0] == greedy[1] == greedy[2] and len(greedy[0]) == 8
    assert (pe_tokens, de_tokens) == (num_prompt_tokens, 2)  # once on the PE; the last token per fork
    sampled, *_ = await choices(temperature=1, seed=5, ignore_eos=True)
    assert len({tuple(s) for s in sampled}) > 1
    ended, *_ = await choices(temperature=0, ignore_eos=True, max_tokens=1)  # choice 0 ends on the PE
    assert len(ended[0]) == 1 and ended[0] == ended[1] == ended[2]  # the DE forked the others all the same
    body = {"model": model, "prompt": f"{uuid.uuid4().hex} long", "n": 3, "max_tokens": 500, "stream": True}
    resp = await http.post(f"{disagg.url}/v1/completions", json={**body, "ignore_eos": True})
    started: set[int] = set()
    while len(started) < 3:  # every choice streams from the DE
        event = orjson.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: ") :])
        started.update(c["index"] for c in event["choices"])
    resp.close()  # the client goes away mid-stream
    await wait_until(lambda: engine_idle(http, de_url), timeout_s=10)


async def test_requests_placed_on_engines_that_died_are_placed_again_on_the_live_ones(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    """Two prefill and two decode engines, one of each SIGKILLed; the router has not heard their silence
    yet (its timeout is a minute), so placements still pick them. A request placed on a dead decode engine,
    or on a dead prefill engine after its decode engine took the turn (the turn is aborted), is placed again
    without it: every request is served with the same tokens, and the dead engines are left out until they
    report again. Before, each such request was a 503 until the silence timeout."""
    s, bus = stack
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--node", "0", "--root", str(tmp_path / "store"))
    engines = {
        e: s.start("engine", e, "--role", role, "--node", "0", "--no-persist-kv", "--no-load-kv")
        for e, role in (("pe-0", "prefill"), ("pe-1", "prefill"), ("de-0", "decode"), ("de-1", "decode"))
    }
    args = ("--http-port", "0", "--policy", "dualpath", "--engine-silence-timeout-s", "60")
    router = s.start("router", "router-0", *args, "--no-use-kv-cache")
    ready = await wait_ready(bus, {"index-0", "storage-0", "router-0", *engines}, s.procs, num_engines=4)
    url = ready["router-0"].http_url
    prompt = [3 + i % 250 for i in range(100)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        first = await complete(http, url, prompt, 4, "d")
        engines["pe-0"].kill()
        engines["de-0"].kill()
        suspected = 0.0
        for batch in range(8):  # until placements met both dead engines (a placement prefers idle ones)
            outs = await asyncio.gather(*(complete(http, url, prompt, 4, f"d{batch}-{i}") for i in range(4)))
            assert all(o["choices"][0]["token_ids"] == first["choices"][0]["token_ids"] for o in outs)
            suspected = await metric(http, url, "kvpath_router_engines_suspected_total")
            if suspected == 2:
                break
    assert suspected == 2 and router.log().count("placed again") >= 2

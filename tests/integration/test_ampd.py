"""AMPD end to end: sessions bound to decode engines that keep their KV, each turn prefilled locally or on a
prefill engine by Algorithm 1, over HTTP, against the model run in this process as the reference.

Which way a turn goes is steered through the per-request SLO extension, as Algorithm 1 reads it: with a
TTFT SLO of an hour every prefill engine has slack (remote); with one of a microsecond none has once it
served a request, and an ITL SLO of an hour gives the decode engine slack (local).
"""

from __future__ import annotations

import asyncio
import random
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq, SamplingOptions
from shared.bus import Bus
from shared.natsserver import NatsServer
from tests.cluster import ServiceProcess, Stack, UpProcess, wait_ready

pytestmark = pytest.mark.slow
BLOCK = 64
REMOTE = {"ttft_slo_ms": 3_600_000}
LOCAL = {"ttft_slo_ms": 0.001, "itl_slo_ms": 3_600_000}
ROUTES = "kvpath_router_session_routes_total"


class Reference:
    """Greedy tokens of the model in this process: one prefill of the whole prompt, then decode steps."""

    def __init__(self, model: str) -> None:
        self.runner = ModelRunner.load(model, device="cpu", num_kv_blocks=128)  # prompts up to 8k tokens
        self.greedy = SamplingOptions(temperature=0.0)

    async def tokens(self, prompt: list[int], n: int) -> list[int]:
        blocks = list(range(-(-(len(prompt) + n) // BLOCK)))
        out = await self.runner.prefill([PrefillSeq("r", blocks, 0, prompt, sampling=self.greedy)])
        tokens = [int(out[0])]
        while len(tokens) < n:
            step = DecodeSeq("r", blocks, len(prompt) + len(tokens) - 1, tokens[-1], sampling=self.greedy)
            tokens.append(int((await self.runner.decode([step]))[0]))
        return tokens


async def complete(
    http: aiohttp.ClientSession, url: str, prompt: list[int], n: int, session: str, model: str, extra: Any
) -> dict[str, Any]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "temperature": 0,
        "return_token_ids": True, **extra,
    }  # fmt: skip
    async with http.post(f"{url}/v1/completions", json=body, headers={"X-Session-Id": session}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def metric(http: aiohttp.ClientSession, url: str, name: str, labels: str = "") -> float:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M) if labels in (m.group(1) or ""))


async def run_turns(
    http: aiohttp.ClientSession,
    url: str,
    session: str,
    routes: list[dict[str, Any]],
    reference: Reference,
    model: str,
    seed: int = 5,
) -> list[dict[str, Any]]:
    """Turns of one session (each prompt = the last prompt + its output + a new append), the route of each
    steered by its SLOs; every turn's tokens are checked against the reference and its route is checked."""
    rng = random.Random(seed)
    context: list[int] = []
    outs = []
    for turn, extra in enumerate(routes):
        prompt = context + [rng.randrange(3, 250) for _ in range((300, 90, 75)[turn % 3])]
        route = "remote" if extra is REMOTE else "local"
        before = await metric(http, url, ROUTES, f'route="{route}"')
        out = await complete(http, url, prompt, 24, session, model, extra)
        assert await metric(http, url, ROUTES, f'route="{route}"') == before + 1, (turn, route)
        tokens = out["choices"][0]["token_ids"]
        assert tokens == await reference.tokens(prompt, 24), (turn, route)
        outs.append(out)
        context = prompt + tokens
    return outs


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, nats_server: NatsServer) -> Iterator[dict[str, Any]]:
    """One PE and two session DEs of 24 blocks each (so sessions get evicted), started one by one so a test
    can kill a decode engine."""
    tmp = tmp_path_factory.mktemp("ampd")
    stack = Stack(tmp, nats_server, "t" + uuid.uuid4().hex[:10])
    engine = ("--model", "tiny", "--num-kv-blocks", "24", "--prefill-order", "slo")
    stack.start("index", "index-0")
    for node in (0, 1):
        stack.start("storage", f"storage-{node}", "--node", str(node), "--root", str(tmp / "store"))
    stack.start("engine", "pe-0", "--role", "prefill", "--node", "0", *engine)
    des = {
        de: stack.start("engine", de, "--role", "decode", "--session-kv", "--node", "1", *engine)
        for de in ("de-a", "de-b")
    }
    router_args = ("--http-port", "0", "--policy", "ampd", "--engine-silence-timeout-s", "1.0")
    stack.start("router", "router-0", *router_args)
    ids = {"index-0", "storage-0", "storage-1", "pe-0", "de-a", "de-b", "router-0"}

    async def ready() -> dict[str, Any]:
        bus = Bus(nats_server.url, stack.namespace, name="test")
        await bus.connect()
        try:
            return await wait_ready(bus, ids, stack.procs, num_engines=3)
        finally:
            await bus.close()

    services = asyncio.run(ready())
    yield {"url": services["router-0"].http_url, "services": services, "des": des}
    stack.stop()


@pytest.fixture(scope="module")
def reference() -> Iterator[Reference]:
    ref = Reference("tiny")
    yield ref
    ref.runner.close()


async def test_greedy_tokens_are_the_same_whether_each_turn_ran_local_or_remote(
    cluster: dict[str, Any], reference: Reference, http: aiohttp.ClientSession
) -> None:
    url = cluster["url"]
    first = await run_turns(http, url, "a", [REMOTE, LOCAL, REMOTE], reference, "tiny")
    second = await run_turns(http, url, "b", [REMOTE, REMOTE, LOCAL], reference, "tiny", seed=6)
    for outs in (first, second):
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
        assert cached[0] == 0 and cached[1] >= 320 - 1 - BLOCK and cached[2] >= 384, cached
    # the local turn kept the whole resident context (the partial block too), not only full blocks
    assert first[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 300 + 24 - 1


async def test_a_session_whose_kv_was_evicted_loads_it_instead_of_recomputing(
    cluster: dict[str, Any], reference: Reference, http: aiohttp.ClientSession
) -> None:
    url, services, des = cluster["url"], cluster["services"], cluster["des"]
    rng = random.Random(11)
    prompt = [rng.randrange(3, 250) for _ in range(1100)]  # 18 of its engine's 24 blocks
    finished = await _finished(http, services, des)
    out = await complete(http, url, prompt, 8, "e1", "tiny", REMOTE)
    bound = await _ran_on(http, services, des, finished)
    evicted = await metric(http, services[bound].http_url, "kvpath_engine_session_evictions_total")
    # 12-block sessions fill the other engine until one binds to e1's (binding takes the lowest
    # occupancy): next to e1 its engine has 6 blocks at most, so that one evicts e1
    for i in range(8):
        await complete(http, url, [rng.randrange(3, 250) for _ in range(700)], 8, f"e-big{i}", "tiny", REMOTE)
        if await metric(http, services[bound].http_url, "kvpath_engine_session_evictions_total") > evicted:
            break
    else:
        pytest.fail(f"no big session evicted on {bound}")
    again = prompt + out["choices"][0]["token_ids"] + [rng.randrange(3, 250) for _ in range(40)]
    local = await complete(http, url, again, 8, "e1", "tiny", LOCAL)
    assert local["usage"]["prompt_tokens_details"]["cached_tokens"] == 1107 // BLOCK * BLOCK  # loaded, stored
    assert local["choices"][0]["token_ids"] == await reference.tokens(again, 8)


async def _finished(
    http: aiohttp.ClientSession, services: dict[str, Any], des: dict[str, Any]
) -> dict[str, float]:
    return {
        de: await metric(http, services[de].http_url, "kvpath_engine_requests_finished_total") for de in des
    }


async def _ran_on(
    http: aiohttp.ClientSession, services: dict[str, Any], des: dict[str, Any], before: dict[str, float]
) -> str:
    """The decode engine that finished a request since `before` (the session's bound engine)."""
    after = await _finished(http, services, des)
    return next(de for de in des if after[de] > before[de])


async def test_bad_slo_fields_fail_alone_with_a_400(
    cluster: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    url = cluster["url"]
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ttft_slo_ms": -1}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        error = (await resp.json())["error"]
        assert (
            resp.status == 400
            and error["param"] == "ttft_slo_ms"
            and error["type"] == "invalid_request_error"
        )
    body.update(ttft_slo_ms=500, itl_slo_ms="fast")
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "itl_slo_ms"
    body.pop("itl_slo_ms")
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200


async def test_a_session_whose_decode_engine_died_rebinds_and_loads_its_kv(
    cluster: dict[str, Any], reference: Reference, http: aiohttp.ClientSession
) -> None:
    """Last in the module: it kills a decode engine."""
    url, services, des = cluster["url"], cluster["services"], cluster["des"]
    finished = await _finished(http, services, des)
    rng = random.Random(13)
    prompt = [rng.randrange(3, 250) for _ in range(400)]
    out = await complete(http, url, prompt, 8, "k", "tiny", LOCAL)
    bound = await _ran_on(http, services, des, finished)
    victim: ServiceProcess = des[bound]
    victim.kill()
    await _until_engines(http, url, 2)  # the router stopped hearing from it
    rebinds = await metric(http, url, "kvpath_router_session_binds_total", 'reason="rebound"')
    again = prompt + out["choices"][0]["token_ids"] + [rng.randrange(3, 250) for _ in range(30)]
    turn = await complete(http, url, again, 8, "k", "tiny", LOCAL)
    assert await metric(http, url, "kvpath_router_session_binds_total", 'reason="rebound"') == rebinds + 1
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] == 407 // BLOCK * BLOCK
    assert turn["choices"][0]["token_ids"] == await reference.tokens(again, 8)


async def _until_engines(http: aiohttp.ClientSession, url: str, count: int) -> None:
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        async with http.get(f"{url}/health") as resp:
            if (await resp.json())["engines"] == count:
                return
        assert asyncio.get_running_loop().time() < deadline, "the router kept the dead engine"
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def mla_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = UpProcess(
        tmp_path_factory.mktemp("ampd-mla"), "--model", "tiny-mla", "--policy", "ampd",
        "--prefill-nodes", "1", "--decode-nodes", "1",
    )  # fmt: skip
    yield up
    assert up.stop() == 0, up.log()


async def test_greedy_tokens_are_the_same_local_or_remote_with_mla(
    mla_cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    reference = Reference("tiny-mla")
    try:
        await run_turns(http, mla_cluster.url, "m", [REMOTE, LOCAL, REMOTE, LOCAL], reference, "tiny-mla")
    finally:
        reference.runner.close()

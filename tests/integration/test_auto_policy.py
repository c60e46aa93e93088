"""`--policy auto`: one cost model picks each request's engine(s) and KV path, counts its plan, and records
its predicted TTFT against the measured one. On colocated engines (`kvpath up --policy auto`) stored
prefixes are still loaded; on a prefill and a session decode engine the P/D paths are taken (remote, local,
history from the decode engine's cache) with the same greedy tokens as one prefill of the whole prompt, and a
dead prefill engine is planned around."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shared.bus import Bus
from shared.natsserver import NatsServer
from shared.protocol import LoadReport
from tests.cluster import ServiceProcess, Stack, UpProcess, wait_ready
from tests.integration.test_ampd import BLOCK, Reference, metric
from tests.integration.test_ampd import reference as reference  # the module's fixture, shared
from tests.integration.test_kv_reuse import complete

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def auto_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    tmp = tmp_path_factory.mktemp("auto")
    up = UpProcess(tmp, "--engines", "1", "--policy", "auto", "--kv-root", str(tmp / "store"))
    yield up
    assert up.stop() == 0, up.log()


async def test_auto_explains_each_plan_and_loads_stored_prefixes(
    auto_cluster: UpProcess, tmp_path: Path
) -> None:
    url = auto_cluster.url
    rng = random.Random(7)
    context: list[int] = []
    cached = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for n in (300, 90, 75):
            prompt = context + [rng.randrange(3, 250) for _ in range(n)]
            out = await complete(http, url, prompt, 16, "auto-session")
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            context = prompt + out["choices"][0]["token_ids"]
        plans = {
            label: await metric(http, url, "kvpath_router_plan_total", f'plan="{label}"')
            for label in ("local/recompute", "local/storage", "local/hbm", "local/pool")
        }
        errors = await metric(http, url, "kvpath_router_plan_ttft_error_seconds_count")
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached
    # the first turn has nothing stored; the next two find their prefix in storage on either engine's node
    assert plans == {"local/recompute": 1, "local/storage": 2, "local/hbm": 0, "local/pool": 0}, plans
    assert errors == 3  # every request's measured TTFT recorded against its prediction


# ------------------------------------------------------------------------------------ prefill/decode engines

# A profile that makes the choices deterministic: a decode engine prefills fast below 200 new tokens and 20x
# slower above, a prefill engine pays 50 ms per prefill. So a long cold prompt goes remote, a short append to
# a resident session stays local, a long one goes remote with its history streamed from the decode engine.
PD_PROFILE = {
    "schema": "kvpath.ampd.profile/1",
    "kv_bytes_per_token": 1000,
    "t_pre": {
        "prefill": {"starts": [0], "coefs": [[0.05, 1e-4, 0]]},
        "decode": {"starts": [0, 200], "coefs": [[0.001, 1e-4, 0], [0.001, 2e-3, 0]]},
    },
    "t_dec": {k: {"starts": [0], "coefs": [[0, 0, 0]]} for k in ("prefill", "decode")},
    "t_kv": {"shm": {"alpha_s": 1e-4, "bytes_per_s": 1e9}, "storage": {"alpha_s": 1e-3, "bytes_per_s": 1e8}},
}
PD_PLANS = (
    "remote/recompute",
    "remote/hbm",
    "remote/storage",
    "remote/storage-de",
    "local/hbm",
    "local/storage",
    "local/recompute",
)


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory, nats_server: NatsServer) -> Iterator[dict[str, Any]]:
    """One prefill engine (node 0) and one session decode engine (node 1) under `--policy auto`, started one
    by one so that a test can kill the prefill engine."""
    yield from pd_stack(tmp_path_factory.mktemp("auto-pd"), nats_server, silence_timeout_s=1.0)


@pytest.fixture(scope="module")
def pd_failover(
    tmp_path_factory: pytest.TempPathFactory, nats_server: NatsServer
) -> Iterator[dict[str, Any]]:
    """The same 1P1D, whose router hears a killed engine's silence only after 30 s: until then its plans
    still name the dead engine, and a request meets the failure in dispatch."""
    no_wait = ("--engine-return-wait-s", "0")  # a request finding no engine fails at once
    yield from pd_stack(
        tmp_path_factory.mktemp("auto-pd-failover"), nats_server, silence_timeout_s=30.0, router_args=no_wait
    )


def pd_stack(
    tmp: Path, nats_server: NatsServer, *, silence_timeout_s: float, router_args: tuple[str, ...] = ()
) -> Iterator[dict[str, Any]]:
    profile = tmp / "profile.json"
    profile.write_text(json.dumps(PD_PROFILE))
    stack = Stack(tmp, nats_server, "t" + uuid.uuid4().hex[:10])
    stack.start("index", "index-0")
    for node in (0, 1):
        stack.start("storage", f"storage-{node}", "--node", str(node), "--root", str(tmp / "store"))
    pe = stack.start("engine", "pe-0", "--role", "prefill", "--node", "0", "--model", "tiny")
    de = stack.start("engine", "de-0", "--role", "decode", "--session-kv", "--node", "1", "--model", "tiny")
    router = ("--http-port", "0", "--policy", "auto", "--cost-profile", str(profile))
    silence = ("--engine-silence-timeout-s", str(silence_timeout_s))
    router_proc = stack.start("router", "router-0", *router, *silence, *router_args)
    ids = {"index-0", "storage-0", "storage-1", "pe-0", "de-0", "router-0"}

    async def ready() -> dict[str, Any]:
        async with contextlib.AsyncExitStack() as cleanup:
            bus = Bus(nats_server.url, stack.namespace, name="test")
            await bus.connect()
            cleanup.push_async_callback(bus.close)
            return await wait_ready(bus, ids, stack.procs, num_engines=2)

    services = asyncio.run(ready())
    yield {
        "url": services["router-0"].http_url,
        "pe": pe,
        "de": de,
        "router": router_proc,
        "namespace": stack.namespace,
    }
    stack.stop()


async def plan_counts(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return {p: await metric(http, url, "kvpath_router_plan_total", f'plan="{p}"') for p in PD_PLANS}


async def turn(
    http: aiohttp.ClientSession, url: str, reference: Reference, prompt: list[int], session: str
) -> tuple[str, list[int], int]:
    """One greedy request checked against the reference; the plan it took, its tokens, its cached tokens."""
    before = await plan_counts(http, url)
    out = await complete(http, url, prompt, 16, session)
    after = await plan_counts(http, url)
    tokens = out["choices"][0]["token_ids"]
    assert tokens == await reference.tokens(prompt, 16)
    (taken,) = [p for p in PD_PLANS if after[p] == before[p] + 1]
    return taken, tokens, out["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_auto_on_prefill_decode_engines_picks_remote_local_and_hbm_paths(
    pd_cluster: dict[str, Any], reference: Reference
) -> None:
    url, rng = pd_cluster["url"], random.Random(3)
    plans, cached, context = [], [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for n in (300, 90, 250):  # cold; a short append; a long append
            prompt = context + [rng.randrange(3, 250) for _ in range(n)]
            taken, tokens, hit = await turn(http, url, reference, prompt, "pd")
            plans.append(taken)
            cached.append(hit)
            context = prompt + tokens
        errors = await metric(http, url, "kvpath_router_plan_ttft_error_seconds_count")
    assert plans == ["remote/recompute", "local/hbm", "remote/hbm"], plans
    # the local turn takes the whole resident context; the remote one the kept blocks, streamed to the PE
    assert cached == [0, 300 + 16 - 1, (406 + 16) // BLOCK * BLOCK], cached
    assert errors >= 3  # each request's measured TTFT against its prediction


async def test_n_choices_on_session_engines_compute_the_prompt_once_and_load_it_for_the_others(
    pd_cluster: dict[str, Any], reference: Reference
) -> None:
    """Session engines sample one choice per task, so n choices are n tasks: choices 1..3 are planned once
    the index lists the prompt that choice 0 computes, and load it (before: four plans that recomputed)."""
    url, rng = pd_cluster["url"], random.Random(11)
    prompt = [rng.randrange(3, 250) for _ in range(300)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "n": 4, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        before = await plan_counts(http, url)
        async with http.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        after = await plan_counts(http, url)
    taken = {p: after[p] - before[p] for p in PD_PLANS if after[p] > before[p]}
    assert sum(taken.values()) == 4, taken
    assert sum(n for p, n in taken.items() if p.endswith("/recompute")) == 1, taken
    expected = await reference.tokens(prompt, 16)
    assert [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])] == [expected] * 4


async def test_a_prefill_engine_killed_mid_prefill_costs_the_client_nothing_and_is_planned_around(
    pd_cluster: dict[str, Any], reference: Reference, nats_server: NatsServer
) -> None:
    """Last in the module: it kills the prefill engine while it prefills a long cold prompt (the decode
    engine holds the turn, and the PE's KV connection to it is open from a first remote turn). The decode
    engine sees the connection close and fails the turn naming the PE; the router leaves the PE out of its
    decisions at once (before its silence is heard: a killed CUDA process can answer its bus for seconds),
    aborts that attempt and dispatches the request again, once, to the decode engine, which prefills it
    itself: the client gets the reference's tokens, no error. Later requests plan around the dead engine."""
    url, rng = pd_cluster["url"], random.Random(4)
    pe: ServiceProcess = pd_cluster["pe"]
    long_prompt = [rng.randrange(3, 250) for _ in range(6000)]
    busy = asyncio.Event()

    async def on_report(report: LoadReport, _ctx: Any) -> None:
        if report.num_running + report.num_waiting > 0:
            busy.set()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        warm = [rng.randrange(3, 250) for _ in range(300)]
        assert (await turn(http, url, reference, warm, "pe-connected"))[0] == "remote/recompute"
    bus = Bus(nats_server.url, pd_cluster["namespace"], name="test-pe-watch")
    await bus.connect()
    try:
        await bus.subscribe(bus.subjects.load("prefill", "pe-0"), LoadReport, on_report)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            before = await plan_counts(http, url)
            redispatched = await metric(http, url, "kvpath_router_requests_redispatched_total")
            suspected = await metric(http, url, "kvpath_router_engines_suspected_total")
            request = asyncio.create_task(complete(http, url, long_prompt, 16, "killed-mid-prefill"))
            await asyncio.wait_for(busy.wait(), 30)  # the PE took the prefill
            pe.kill()  # SIGKILL, mid-prefill
            out = await asyncio.wait_for(request, 60)
            after = await plan_counts(http, url)
            assert out["choices"][0]["token_ids"] == await reference.tokens(long_prompt, 16)
            assert await metric(http, url, "kvpath_router_requests_redispatched_total") == redispatched + 1
            assert await metric(http, url, "kvpath_router_engines_suspected_total") == suspected + 1
            assert after["remote/recompute"] == before["remote/recompute"] + 1  # the attempt the PE took
            assert after["local/recompute"] == before["local/recompute"] + 1  # the decode engine's
    finally:
        await bus.close()
    log = pd_cluster["router"].log()
    assert "dispatched again as" in log and "engine suspect engine=pe-0" in log, log
    assert "auto plan failed" not in log, log  # the redispatch never tried the dead PE
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        deadline = asyncio.get_running_loop().time() + 10
        while not await router_sees_exactly(http, url, 1):  # the router stopped hearing from the PE
            assert asyncio.get_running_loop().time() < deadline, "the router kept the dead prefill engine"
            await asyncio.sleep(0.05)
        prompt = [rng.randrange(3, 250) for _ in range(300)]  # remote while the PE lived
        taken, tokens, _ = await turn(http, url, reference, prompt, "dead-pe")
        assert taken == "local/recompute"
        again, _, hit = await turn(http, url, reference, prompt + tokens + [7] * 40, "dead-pe")
        assert again == "local/hbm" and hit == 300 + 16 - 1


async def router_sees_exactly(http: aiohttp.ClientSession, url: str, count: int) -> bool:
    async with http.get(f"{url}/health") as resp:
        return bool((await resp.json())["engines"] == count)


async def test_auto_prefills_on_the_decode_engine_when_the_only_prefill_engine_died_after_it_took_the_turn(
    pd_failover: dict[str, Any], reference: Reference
) -> None:
    """The router still plans remote on the killed PE: the decode engine takes the turn, the PE does not
    answer, and the request is prefilled locally on the decode engine under a retry's own id (the abort of
    the first attempt does not meet it), with the reference's greedy tokens; the next turn finds the
    session's KV resident."""
    url, rng = pd_failover["url"], random.Random(5)
    pd_failover["pe"].kill()  # SIGKILL
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        assert await router_sees_exactly(http, url, 2)  # the kill is not heard yet: plans still name the PE
        prompt = [rng.randrange(3, 250) for _ in range(300)]  # remote while the PE lives
        taken, tokens, _ = await turn(http, url, reference, prompt, "pe-died")
        again, _, hit = await turn(http, url, reference, prompt + tokens + [7] * 40, "pe-died")
        assert await router_sees_exactly(http, url, 1)  # the PE no service answers for is left out
    assert (taken, again, hit) == ("local/recompute", "local/hbm", 300 + 16 - 1)
    failed = pd_failover["router"].log()
    assert "plan=remote/recompute engine=pe-0" in failed, failed  # the first attempt met the dead PE


async def test_auto_fails_fast_with_an_openai_error_when_the_only_decode_engine_died(
    pd_failover: dict[str, Any],
) -> None:
    """Last on `pd_failover`: it kills the decode engine. A request meets it gone in dispatch and fails at
    once with OpenAI's error body (streamed or not), never waiting for the silence (`engine_return_wait_s`
    is 0 on this router; by default it would wait that long for an engine to come back)."""
    url = pd_failover["url"]
    pd_failover["de"].kill()
    body = {"model": "tiny", "prompt": [5] * 300, "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for stream in (False, True):
            async with http.post(f"{url}/v1/completions", json=body | {"stream": stream}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 503 and error["code"] == "no_engine_available", error
        # failed fast, before the router heard the silence: the decode engine no service answers for is left
        # out (as the PE before it), and this router does not wait for engines to return
        assert await router_sees_exactly(http, url, 0)


async def test_kvpath_up_starts_dualpath_decode_engines_for_auto(
    tmp_path: Path, reference: Reference
) -> None:
    """`kvpath up --policy auto --auto-decode-engines dualpath`: decode-only engines, so every turn is
    prefilled on the PE; the second finds the first's prefix stored (read on either node)."""
    pd = ("--prefill-nodes", "1", "--decode-nodes", "1")
    up = UpProcess(tmp_path, "--policy", "auto", *pd, "--auto-decode-engines", "dualpath")
    try:
        rng = random.Random(6)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            prompt = [rng.randrange(3, 250) for _ in range(300)]
            first, tokens, _ = await turn(http, up.url, reference, prompt, "dualpath")
            second, _, hit = await turn(http, up.url, reference, prompt + tokens + [9] * 40, "dualpath")
    finally:
        assert up.stop() == 0, up.log()
    assert first == "remote/recompute" and second in ("remote/storage", "remote/storage-de"), (first, second)
    assert hit == 300 // BLOCK * BLOCK

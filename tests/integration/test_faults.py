"""Faults through separately started service processes: no engine, a dying engine, junk on the bus,
deadlines, and token coalescing on the bus."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from services.up.process import ServiceProcess
from shared.bus import Bus
from shared.protocol import (
    ErrorReply,
    GenerateTask,
    LoadReport,
    RequestPlan,
    SamplingParams,
    TaskAck,
    TokenBatch,
    decode,
)
from tests.cluster import Stack, wait_ready
from tests.integration.test_ampd import metric
from tests.integration.test_api import engine_idle, wait_until

pytestmark = pytest.mark.slow


ROUTER_ARGS = ("--http-port", "0", "--engine-silence-timeout-s", "1.0")


@pytest.mark.parametrize("policy", ["colocated", "dualpath"])
async def test_no_engine_is_503_with_retry_after(stack: tuple[Stack, Bus], policy: str) -> None:
    s, bus = stack
    s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache", "--policy", policy)
    ready = await wait_ready(bus, {"router-0"}, s.procs)
    url = ready["router-0"].http_url
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            err = (await resp.json())["error"]
        async with http.get(f"{url}/health") as health, http.get(f"{url}/ready") as ready_resp:
            assert health.status == 200  # alive: no reason to restart it
            assert ready_resp.status == 503 and (await ready_resp.json())["reason"] == "no engine"
    assert err["code"] == "no_engine_available" and err["type"] == "service_unavailable"


async def test_engine_death_mid_stream_ends_with_error_event(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache")
    engine = s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    url = ready["router-0"].http_url
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.get(f"{url}/ready") as ready_resp:
            assert ready_resp.status == 200
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            engine.kill()
            rest = (await resp.read()).decode()
    assert rest.endswith("data: [DONE]\n\n")
    assert '"error"' in rest and "engine-0 stopped responding" in rest


async def test_an_engine_killed_before_the_first_token_costs_the_client_nothing(
    stack: tuple[Stack, Bus],
) -> None:
    """The engine that took a long prompt dies mid-prefill: once the router hears its silence it aborts that
    attempt and dispatches the request again, to the other engine; the client gets a whole answer (the same
    greedy tokens as the survivor gives the prompt afterwards) and no error."""
    s, bus = stack
    router = s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache")
    engines = {i: s.start("engine", i, "--no-persist-kv", "--no-load-kv") for i in ("engine-0", "engine-1")}
    ready = await wait_ready(bus, {"router-0", *engines}, s.procs)
    url = ready["router-0"].http_url
    busy: asyncio.Queue[str] = asyncio.Queue()

    async def on_report(report: LoadReport, _ctx: object) -> None:
        if report.num_running + report.num_waiting > 0:
            busy.put_nowait(report.service_id)

    for engine_id in engines:
        await bus.subscribe(bus.subjects.load("colocated", engine_id), LoadReport, on_report)
    # long enough that its prefill (~1.3 s on CPU; it runs three times: taken, sent again, the check) far
    # outlasts the load report (0.1 s) that tells which engine took it: the kill lands before its first token
    prompt = [(7 * i) % 240 + 3 for i in range(4000)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        request = asyncio.ensure_future(_complete(http, url, body))
        taken = await asyncio.wait_for(busy.get(), 30)  # the engine that took it, mid-prefill
        engines[taken].kill()
        status, out = await request
        assert status == 200, out
        again_status, again = await _complete(http, url, body)  # on the survivor alone
    assert again_status == 200, again
    assert out["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    assert len(out["choices"][0]["token_ids"]) == 4
    assert f"engine {taken} lost" in router.log(), router.log()


async def test_malformed_task_is_answered_and_engine_survives(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache")
    s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    out_of_range = [  # well-formed, but outside the schema's ranges: refused at admission, never batched
        _task({"sampling": {"temperature": -5}}),
        _task({"sampling": {"max_tokens": -1}}),
        _task({"router_id": "a.b.>"}),
    ]
    for junk in (b"\x00garbage", b'{"kind": "generate_task", "v": 1, "request_id": 5}', b"[]", *out_of_range):
        reply = await bus.nc.request(bus.subjects.task("engine-0"), junk, timeout=5)
        err = decode(reply.data, ErrorReply)
        assert err.code == "bad_message" and err.message
    reply = await bus.nc.request(bus.subjects.task("engine-0"), _task({"deadline_unix_s": 1.0}), timeout=5)
    ack = decode(reply.data, TaskAck)  # 1970: well-formed, refused by the engine
    assert not ack.accepted and ack.code == "deadline_exceeded"
    async with aiohttp.ClientSession() as http:
        url = ready["router-0"].http_url
        greedy = {"model": "tiny", "prompt": "ok", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        bodies = [{**greedy, "top_p": 0.0}, greedy, {**greedy, "top_p": 0.5, "temperature": 1.0}]
        results = await asyncio.gather(*(_complete(http, url, body) for body in bodies))
    assert all(status == 200 for status, _ in results)
    assert results[0][1]["choices"][0]["text"] == results[1][1]["choices"][0]["text"]  # top_p 0 is greedy
    assert all(r["usage"]["completion_tokens"] == 3 for _, r in results)


def _task(change: dict) -> bytes:
    plan = RequestPlan(
        request_id="junk-1",
        router_id="router-0",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4),
        deadline_unix_s=time.time() + 30,
    ).to_dict()
    for key, value in change.items():
        if isinstance(value, dict):
            plan[key].update(value)
        else:
            plan[key] = value
    return orjson.dumps({"kind": GenerateTask.KIND, "v": GenerateTask.VERSION, "plan": plan, "timings": {}})


async def _complete(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def test_request_deadline_is_504(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache", "--request-deadline-s", "0.5")
    s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{ready['router-0'].http_url}/v1/completions", json=body) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "deadline_exceeded"


async def test_an_engine_that_never_acks_is_504_at_the_deadline(stack: tuple[Stack, Bus]) -> None:
    """A frozen engine (SIGSTOP: registered, subscribed, silent) swallows the dispatch until the request's
    deadline: that is a 504 as in disaggregated mode, not a 503."""
    s, bus = stack
    router_args = ("--http-port", "0", "--no-use-kv-cache", "--request-deadline-s", "1.0")
    s.start("router", "router-0", *router_args, "--engine-silence-timeout-s", "30")
    engine = s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    engine.proc.send_signal(signal.SIGSTOP)
    try:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{ready['router-0'].http_url}/v1/completions", json=body) as resp:
                status, err = resp.status, (await resp.json())["error"]
    finally:
        engine.proc.send_signal(signal.SIGCONT)
    assert status == 504 and err["code"] == "deadline_exceeded", err


async def test_tokens_are_coalesced_per_engine_step(stack: tuple[Stack, Bus]) -> None:
    s, bus = stack
    s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache")
    s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv")
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    batches: list[TokenBatch] = []

    async def on_tokens(msg) -> None:  # type: ignore[no-untyped-def]
        batches.append(decode(msg.data, TokenBatch))

    await bus.subscribe_raw(bus.subjects.tokens("router-0"), on_tokens)
    await bus.flush()
    n_streams, n_tokens = 8, 20
    body = {"model": "tiny", "prompt": "x", "max_tokens": n_tokens, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:

        async def one() -> int:
            async with http.post(f"{ready['router-0'].http_url}/v1/completions", json=body) as resp:
                return int((await resp.json())["usage"]["completion_tokens"])

        assert await asyncio.gather(*(one() for _ in range(n_streams))) == [n_tokens] * n_streams
    await bus.flush()
    total = sum(len(d.token_ids) for b in batches for d in b.deltas)
    assert total == n_streams * n_tokens
    # one message per engine step, not per token: far fewer messages than tokens
    assert len(batches) <= total / 3, (len(batches), total)
    assert max(len(b.deltas) for b in batches) >= n_streams // 2


ROUTER_DIES_ARGS = ("--http-port", "0", "--no-use-kv-cache")


async def _router_killed_mid_stream(s: Stack, bus: Bus, http: aiohttp.ClientSession, *args: str) -> str:
    """A router and an engine (`args` to both); a request of 8,000 tokens (~10 s here) streams, and the router
    is SIGKILLed once its first event came; return the engine's URL."""
    router = s.start("router", "router-0", *ROUTER_DIES_ARGS, *args)
    s.start("engine", "engine-0", "--no-persist-kv", "--no-load-kv", *args)
    ready = await wait_ready(bus, {"router-0", "engine-0"}, s.procs)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": True}
    async with http.post(f"{ready['router-0'].http_url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        router.kill()
    return ready["engine-0"].http_url


async def test_a_restarted_routers_orphaned_requests_are_aborted(
    stack: tuple[Stack, Bus], http: aiohttp.ClientSession
) -> None:
    """The router dies mid-stream and a new process comes back under its id (as `kvpath up` or a Kubernetes
    pod restarts it): the request the old process had sent out has no client any more, and the engine, which
    kept decoding it, is told to stop on its next token batch instead of decoding to `max_tokens`, holding
    KV and a batch slot the new router's requests need."""
    s, bus = stack
    engine_url = await _router_killed_mid_stream(s, bus, http)
    s.start("router", "router-0", *ROUTER_DIES_ARGS)  # the same id: the engine's deltas now reach it
    again = await wait_ready(bus, {"router-0"}, s.procs)
    await wait_until(lambda: engine_idle(http, engine_url), timeout_s=8)
    finished = await metric(http, engine_url, "kvpath_engine_requests_finished_total")
    aborted = await metric(http, engine_url, "kvpath_engine_requests_finished_total", 'reason="abort"')
    orphans = await metric(http, again["router-0"].http_url, "kvpath_router_orphans_aborted_total")
    assert (finished, aborted) == (1, 1)  # stopped, not decoded to its end
    assert orphans >= 1


async def test_a_router_gone_for_good_has_its_requests_aborted_by_the_engine(
    stack: tuple[Stack, Bus], http: aiohttp.ClientSession
) -> None:
    """The router dies and nothing restarts it under its id (a pod rescheduled under a new name): once its
    registry entry has been gone for three looks, the engine aborts the request it was decoding for it
    instead of decoding it to the end for nobody."""
    s, bus = stack
    ttl = ("--registry-ttl-s", "1.0", "--heartbeat-interval-s", "0.3")
    engine_url = await _router_killed_mid_stream(s, bus, http, *ttl)
    await wait_until(lambda: engine_idle(http, engine_url), timeout_s=8)
    finished = await metric(http, engine_url, "kvpath_engine_requests_finished_total")
    aborted = await metric(http, engine_url, "kvpath_engine_router_gone_aborts_total")
    assert (finished, aborted) == (1, 1)


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1.0, "seed": 11}, {"temperature": 1.0, "seed": 11, "n": 2}],
    ids=["greedy", "seeded", "two-choices"],
)
async def test_an_engine_killed_mid_decode_migrates_the_stream(
    stack: tuple[Stack, Bus], sampling: dict
) -> None:
    """The engine decoding a streamed request dies after tokens went out: the router dispatches it to the
    other engine with the tokens the client got, and the stream goes on where it broke, no error, the same
    text as the request run whole (greedy, or seeded sampling: the generator is caught up; n = 2 choices
    of one task: each goes on alone, with its own seed). Before, the client got an error event."""
    s, bus = stack
    router = s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache")
    engines = {i: s.start("engine", i, "--no-persist-kv", "--no-load-kv") for i in ("engine-0", "engine-1")}
    ready = await wait_ready(bus, {"router-0", *engines}, s.procs)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        killed = await _killed_mid_stream(http, ready, engines, {"prompt": "migrate", **sampling})
    assert "migrated after" in router.log() and f"engine {killed} lost" in router.log()


async def test_a_migrated_request_loads_the_stored_kv_of_its_output_so_far(
    stack: tuple[Stack, Bus], tmp_path: Path
) -> None:
    """With KV stored, the engine that takes a migrated request loads the blocks of its prompt and of the
    output the client got (their KV was stored as blocks filled) instead of computing them: before, it
    recomputed the output's. The text is still the request's run whole."""
    s, bus = stack
    s.start("index", "index-0")
    s.start("storage", "storage-0", "--root", str(tmp_path / "store"))
    s.start("router", "router-0", *ROUTER_ARGS)
    engines = {i: s.start("engine", i) for i in ("engine-0", "engine-1")}
    ready = await wait_ready(bus, {"router-0", "index-0", "storage-0", *engines}, s.procs)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        fields = {"prompt": "migrate", "temperature": 0}
        killed = await _killed_mid_stream(http, ready, engines, fields, after_events=200)
        survivor = ready[next(i for i in engines if i != killed)].http_url
        loaded = await metric(http, survivor, "kvpath_engine_kv_loaded_blocks_total")
    assert loaded >= 3  # 200 events: 200 tokens or more, 3 blocks of 64 (the prompt is not one)


@pytest.mark.parametrize("policy", ["ampd", "dualpath", "auto"])
async def test_a_decode_engine_killed_mid_decode_migrates_the_stream(
    stack: tuple[Stack, Bus], policy: str
) -> None:
    """One prefill and two decode engines (AMPD's session engines, DualPath's decode-only ones, auto on
    session engines): the decode engine streaming a request dies; the request migrates through the same
    dispatch, its prompt followed by the tokens the client got (on DualPath the prefill engine prefills them
    and hands them to the other decode engine), the same text as the request run whole (greedy; DualPath
    seeded, both engines' generators caught up). Before, DualPath's stream ended with an error."""
    s, bus = stack
    engine = ("--no-persist-kv", "--no-load-kv")
    session = ("--session-kv",) if policy != "dualpath" else ()
    router = s.start("router", "router-0", *ROUTER_ARGS, "--no-use-kv-cache", "--policy", policy)
    s.start("engine", "pe-0", "--role", "prefill", *engine)
    des = {i: s.start("engine", i, "--role", "decode", *session, *engine) for i in ("de-a", "de-b")}
    ready = await wait_ready(bus, {"router-0", "pe-0", *des}, s.procs, num_engines=3)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        sampling = {"temperature": 1.0, "seed": 11} if policy == "dualpath" else {"temperature": 0}
        await _killed_mid_stream(http, ready, des, {"prompt": "migrate a session", **sampling})
    assert "migrated after" in router.log()


async def _killed_mid_stream(
    http: aiohttp.ClientSession,
    ready: dict,
    engines: dict[str, ServiceProcess],
    fields: dict,
    *,
    after_events: int = 1,
) -> str:
    """A request of 1,200 tokens run whole, then streamed, the engine decoding it killed after its first
    `after_events` events: the stream ends without an error and with the whole run's text; returns the
    killed engine."""
    url = ready["router-0"].http_url
    body = {"model": "tiny", "max_tokens": 1200, "ignore_eos": True, **fields}
    status, whole = await _complete(http, url, body)
    assert status == 200, whole
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        head = b"".join([await resp.content.readuntil(b"\n\n") for _ in range(after_events)])
        serving = [i for i in engines if await _is_running(http, ready[i].http_url)]
        engines[serving[0]].kill()
        events = (head + await resp.read()).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [orjson.loads(e[len("data: ") :]) for e in events[:-2]]
    assert all("error" not in c for c in chunks), chunks[-1]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == "length"
    return serving[0]


async def _is_running(http: aiohttp.ClientSession, engine_url: str) -> bool:
    async with http.get(f"{engine_url}/health") as resp:
        return bool((await resp.json())["num_running"])


async def test_an_ampd_turn_whose_prefill_engine_is_gone_runs_on_its_decode_engine(
    stack: tuple[Stack, Bus],
) -> None:
    """AMPD on 1P1D, the prefill engine SIGKILLed and its silence not heard yet (a minute's timeout): a
    turn sent remote finds no service answering the PE after its decode engine took it; the PE is left out
    until it reports again and the turn is decided again, under an id of its own, and runs locally, the
    same greedy tokens. Before, every such turn was a 502 until the router heard the silence."""
    s, bus = stack
    engine = ("--no-persist-kv", "--no-load-kv")
    args = ("--http-port", "0", "--no-use-kv-cache", "--policy", "ampd", "--engine-silence-timeout-s", "60")
    router = s.start("router", "router-0", *args)
    pe = s.start("engine", "pe-0", "--role", "prefill", *engine)
    s.start("engine", "de-0", "--role", "decode", "--session-kv", *engine)
    ready = await wait_ready(bus, {"router-0", "pe-0", "de-0"}, s.procs, num_engines=2)
    url = ready["router-0"].http_url
    body = {"model": "tiny", "prompt": [5] * 600, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        status, first = await _complete(http, url, body)
        assert status == 200, first
        remote = await metric(http, url, "kvpath_router_session_routes_total", 'route="remote"')
        pe.kill()
        for session in ("b", "c"):
            async with http.post(
                f"{url}/v1/completions", json=body, headers={"X-Session-Id": session}
            ) as resp:
                out = await resp.json()
            assert resp.status == 200, out
            assert out["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        suspected = await metric(http, url, "kvpath_router_engines_suspected_total")
    assert remote == 1 and suspected == 1  # the first turn ran remote; the second found the PE gone
    assert "prefill engine gone" in router.log()

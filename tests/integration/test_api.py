"""The OpenAI-compatible API end to end: `kvpath up` as a real process tree (nats-server, router, engine)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(cold_cluster: UpProcess) -> UpProcess:
    """`kvpath up --no-kv-store --router-arg=--max-tokens-limit 512`, shared (tests/conftest.py)."""
    return cold_cluster


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    """Parse an SSE body strictly: every event is `data: ...` followed by a blank line."""
    body = (await resp.read()).decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def test_completion_json(cluster: UpProcess, http: aiohttp.ClientSession) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    async with http.post(f"{cluster.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        out = await resp.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert out["choices"][0]["finish_reason"] == "length"
    usage = out["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_completion_stream_with_usage(cluster: UpProcess, http: aiohttp.ClientSession) -> None:
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(f"{cluster.url}/v1/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # same text as the non-streamed request (greedy)
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    body.pop("stream_options")
    body["stream"] = False
    async with http.post(f"{cluster.url}/v1/completions", json=body) as resp:
        assert (await resp.json())["choices"][0]["text"] == streamed


async def test_chat_json_and_stream(cluster: UpProcess, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    async with http.post(f"{cluster.url}/v1/chat/completions", json=body) as resp:
        out = await resp.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    async with http.post(f"{cluster.url}/v1/chat/completions", json={**body, "stream": True}) as resp:
        events = await sse_events(resp)
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == out["choices"][0]["message"]["content"]


async def test_openai_client_streams_chat_with_usage(cluster: UpProcess) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-2].choices[0].finish_reason == "length"
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    await client.close()


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", b"{not json", "body", "invalid_request"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "model", "model_not_found"),
        ("/v1/completions", {"model": "tiny", "prompt": 5}, "prompt", "invalid_request"),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "max_tokens": "5"},
            "max_tokens",
            "invalid_request",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "max_tokens": 0},
            "max_tokens",
            "invalid_request",
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": "x", "max_tokens": 513},
            "max_tokens",
            "invalid_request",
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "x" * 9000}, "prompt", "context_length_exceeded"),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": [1, 2], "max_tokens": 8191},
            "max_tokens",
            "invalid_request",
        ),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages", "invalid_request"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            "temperature",
            "invalid_request",
        ),
    ],
)
async def test_bad_input(
    cluster: UpProcess, http: aiohttp.ClientSession, path: str, body: Any, param: str, code: str
) -> None:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(
        f"{cluster.url}{path}", data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == (404 if code == "model_not_found" else 400)
        err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error"
    assert err["message"]


async def test_client_disconnect_aborts_and_frees_the_engine(
    cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    engine_url = next(u for name, u in cluster.services.items() if name.startswith("engine"))
    body = {"model": "tiny", "prompt": "long", "max_tokens": 500, "ignore_eos": True, "stream": True}
    resp = await http.post(f"{cluster.url}/v1/completions", json=body)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")  # streaming has begun
    health = await (await http.get(f"{engine_url}/health")).json()
    assert health["num_running"] + health["num_waiting"] == 1
    resp.close()  # the client goes away mid-stream
    await wait_until(lambda: engine_idle(http, engine_url), timeout_s=10)


async def test_n_choices_prefill_once_and_a_disconnect_frees_them_all(
    cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    """n streamed choices: one prefill of the prompt on the engine, n sequences decoding; the client going
    away aborts all n and frees every block."""
    engine_url = next(u for name, u in cluster.services.items() if name.startswith("engine"))
    prompt = "a prompt of a few blocks, " * 12
    async with http.post(f"{cluster.url}/tokenize", json={"model": "tiny", "prompt": prompt}) as resp:
        num_prompt_tokens = (await resp.json())["count"]
    prefilled = await prefill_tokens(http, engine_url)
    body = {"model": "tiny", "prompt": prompt, "n": 4, "max_tokens": 500, "ignore_eos": True, "stream": True}
    resp = await http.post(f"{cluster.url}/v1/completions", json=body)
    assert resp.status == 200
    started: set[int] = set()
    while len(started) < 4:  # every choice has streamed a token
        event = orjson.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: ") :])
        started.update(c["index"] for c in event["choices"])
    health = await (await http.get(f"{engine_url}/health")).json()
    assert health["num_running"] == 4
    assert await prefill_tokens(http, engine_url) - prefilled == num_prompt_tokens  # once, not 4 times
    resp.close()  # the client goes away mid-stream
    await wait_until(lambda: engine_idle(http, engine_url), timeout_s=10)


async def test_n_choices_of_a_prompt_prefilled_in_chunks(
    cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    """A prompt longer than one step's prefill budget (2,048 tokens) is prefilled in chunks; the choices
    waiting on it get their first tokens with the last chunk only (before, the first chunk failed the
    request: no first tokens came back for them)."""
    prompt = [random.Random(3).randrange(3, 250) for _ in range(2_300)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    async with http.post(f"{cluster.url}/v1/completions", json={**body, "n": 3}) as resp:
        assert resp.status == 200, await resp.text()
        texts = [c["text"] for c in (await resp.json())["choices"]]
    async with http.post(f"{cluster.url}/v1/completions", json=body) as resp:
        alone = (await resp.json())["choices"][0]["text"]
    assert texts == [alone] * 3  # greedy: every choice is the single completion


async def test_a_stop_string_ends_every_choice_on_the_engine_too(
    cluster: UpProcess, http: aiohttp.ClientSession
) -> None:
    """The router matches stop strings; a choice that hit one is aborted on the engine at once (it would
    otherwise decode on to max_tokens for nobody)."""
    engine_url = next(u for name, u in cluster.services.items() if name.startswith("engine"))
    base = {"model": "tiny", "prompt": [72, 105], "ignore_eos": True, "temperature": 0}
    async with http.post(f"{cluster.url}/v1/completions", json={**base, "max_tokens": 12}) as resp:
        stop = (await resp.json())["choices"][0]["text"][4:7]
    aborted = await finished(http, engine_url, "abort")
    body = {**base, "max_tokens": 500, "n": 2, "stop": [stop]}
    async with http.post(f"{cluster.url}/v1/completions", json=body) as resp:
        assert [c["finish_reason"] for c in (await resp.json())["choices"]] == ["stop", "stop"]
    await wait_until(lambda: _more(finished(http, engine_url, "abort"), aborted + 2), timeout_s=10)
    await wait_until(lambda: engine_idle(http, engine_url), timeout_s=10)


async def finished(http: aiohttp.ClientSession, engine_url: str, reason: str) -> float:
    text = await (await http.get(f"{engine_url}/metrics")).text()
    line = f'kvpath_engine_requests_finished_total{{reason="{reason}"}} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


async def _more(value: Any, at_least: float) -> bool:
    return float(await value) >= at_least


async def prefill_tokens(http: aiohttp.ClientSession, engine_url: str) -> float:
    text = await (await http.get(f"{engine_url}/metrics")).text()
    [line] = [x for x in text.splitlines() if x.startswith("kvpath_engine_prefill_tokens_total ")]
    return float(line.split()[1])


async def engine_idle(http: aiohttp.ClientSession, engine_url: str) -> bool:
    health = await (await http.get(f"{engine_url}/health")).json()
    return (
        health["num_running"] == 0
        and health["num_waiting"] == 0
        and (health["free_kv_blocks"] == health["total_kv_blocks"])
    )


async def wait_until(check: Any, *, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_greedy_output_equals_the_runtime(cluster: UpProcess, http: aiohttp.ClientSession) -> None:
    from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq, SamplingOptions

    prompt_ids = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
    n_new = 12
    runner = ModelRunner.load("tiny", num_kv_blocks=8)
    try:
        blocks = runner.kv.allocate(1)
        greedy = SamplingOptions(temperature=0.0)
        [tok] = await runner.prefill([PrefillSeq("s", blocks, 0, prompt_ids, sampling=greedy)])
        out = [tok]
        for i in range(n_new - 1):
            [tok] = await runner.decode(
                [DecodeSeq("s", blocks, len(prompt_ids) + i, out[-1], sampling=greedy)]
            )
            out.append(tok)
        expected = runner.tokenizer.decode(out)
    finally:
        runner.close()
    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": n_new, "ignore_eos": True, "temperature": 0}
    async with http.post(f"{cluster.url}/v1/completions", json=body) as resp:
        assert (await resp.json())["choices"][0]["text"] == expected


def test_up_stops_everything(tmp_path: Path) -> None:
    import psutil

    up = UpProcess(tmp_path, "--no-kv-store")
    children = psutil.Process(up.proc.pid).children(recursive=True)
    assert len(children) >= 3  # nats-server, router, engine
    assert up.stop() == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans: {alive}"
    assert not Path(up.info["tmp_dir"]).exists()

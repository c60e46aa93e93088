"""The OpenAI features agents use, through the official `openai` client against `kvpath up` (the tiny model:
its random weights make every constraint visible, since only the grammar keeps its output well-formed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.cluster import UpProcess

pytestmark = pytest.mark.slow
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "maximum": 999},
                    "b": {"type": "integer", "maximum": 999},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(cold_cluster: UpProcess) -> UpProcess:
    """`kvpath up --no-kv-store` (tests/conftest.py, shared)."""
    return cold_cluster


@pytest.fixture
async def client(cluster: UpProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def test_json_schema_output_is_always_valid(client: openai.AsyncOpenAI) -> None:
    """100 samples at temperature 1: every one parses and validates (the grammar, not the model)."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def sample(seed: int) -> list[str]:
        out = await client.chat.completions.create(
            model="tiny", messages=_user("a person"), n=10, seed=100 * seed, temperature=1, max_tokens=120,
            response_format=fmt,
        )  # fmt: skip
        assert all(c.finish_reason == "stop" for c in out.choices)
        return [c.message.content or "" for c in out.choices]

    texts = [t for batch in await asyncio.gather(*(sample(s) for s in range(10))) for t in batch]
    assert len(texts) == 100 and len(set(texts)) > 50  # sampled, not one answer repeated
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    objects = await client.chat.completions.create(
        model="tiny",
        messages=_user("x"),
        n=8,
        temperature=1,
        max_tokens=80,
        response_format={"type": "json_object"},
    )
    for choice in objects.choices:  # any object; random weights may still be writing one at max_tokens
        text = choice.message.content or ""
        assert isinstance(json.loads(text), dict) if choice.finish_reason == "stop" else text.startswith("{")
    assert any(c.finish_reason == "stop" for c in objects.choices)


async def test_a_streamed_tool_calling_agent_loop(client: openai.AsyncOpenAI) -> None:
    """3 tools, 5 turns, streamed: each turn's calls arrive as OpenAI deltas and validate."""
    messages: list[Any] = _user("help me")
    for turn in range(5):
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1, seed=turn, max_tokens=120, stream=True,
        )  # fmt: skip
        calls: dict[int, dict[str, str]] = {}
        finish = None
        async for chunk in stream:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta_call.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = delta_call.id or call["id"]
                assert delta_call.function is not None
                call["name"] += delta_call.function.name or ""
                call["arguments"] += delta_call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and len(calls) == 1, (turn, calls, finish)
        call = calls[0]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert call["id"].startswith("call_")
        function = {"name": call["name"], "arguments": call["arguments"]}
        history = [{"id": call["id"], "type": "function", "function": function}]
        messages.append({"role": "assistant", "content": None, "tool_calls": history})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})


async def test_a_named_function_and_tool_choice_none(client: openai.AsyncOpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "add"}}
    out = await client.chat.completions.create(
        model="tiny",
        messages=_user("1+2"),
        tools=TOOLS,
        tool_choice=named,
        temperature=1,
        max_tokens=240,
        seed=11,
    )  # seeded: unseeded sampling of random weights could run out of tokens inside the JSON now and then
    [call] = out.choices[0].message.tool_calls or []
    assert (
        call.type == "function"
        and call.function.name == "add"
        and out.choices[0].finish_reason == "tool_calls"
    )
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])
    plain = await client.chat.completions.create(
        model="tiny", messages=_user("hi"), tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content is not None


async def test_logprobs_streamed_and_not_agree(client: openai.AsyncOpenAI) -> None:
    kwargs: Any = {"model": "tiny", "messages": _user("hello"), "max_tokens": 6, "temperature": 0}
    kwargs |= {"logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True}}
    whole = await client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes or []).decode(errors="replace") is not None
    streamed = []
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    legacy = await client.completions.create(
        model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = legacy.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 4 and len(lp.top_logprobs or []) == 4
    assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(4)]


async def test_n_choices_echo_and_sampling_parameters_apply(client: openai.AsyncOpenAI) -> None:
    many = await client.completions.create(
        model="tiny", prompt="abc", n=3, seed=7, max_tokens=8, temperature=1
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and len({c.text for c in many.choices}) > 1
    assert many.usage is not None and many.usage.completion_tokens >= 3  # summed over the choices
    echo = await client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("abc")
    base: Any = {"model": "tiny", "prompt": "abc", "max_tokens": 12}
    greedy = await client.completions.create(**base, temperature=0, extra_body={"ignore_eos": True})
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # each leaves only the most likely token
        only = await client.completions.create(
            **base, temperature=1, extra_body={"ignore_eos": True, **extra}
        )
        assert only.choices[0].text == greedy.choices[0].text, extra
    base["extra_body"] = {"ignore_eos": True}
    forced = await client.completions.create(**base, temperature=0, logit_bias={str(ord("z")): 100})
    assert forced.choices[0].text == "z" * 12
    repeated = await client.completions.create(
        **base, temperature=0, logit_bias={str(ord("z")): 5}, frequency_penalty=2.0
    )
    assert repeated.choices[0].text != "z" * 12  # each z costs 2 more: the bias stops winning


async def test_bad_parameters_fail_alone_with_openai_errors(client: openai.AsyncOpenAI) -> None:
    good = client.completions.create(model="tiny", prompt="ok", max_tokens=4, temperature=0)
    bad = client.completions.create(model="tiny", prompt="ok", max_tokens=4, logit_bias={"99999": 1})
    bad_n = client.completions.create(model="tiny", prompt="ok", max_tokens=4, n=3, logit_bias={"99999": 1})
    results = await asyncio.gather(good, bad, bad_n, return_exceptions=True)
    assert not isinstance(results[0], BaseException) and results[0].choices[0].text is not None
    for refused in results[1:]:  # the engine refuses the task; with n = 3 every choice fails with it
        assert isinstance(refused, openai.BadRequestError) and refused.body["param"] == "logit_bias"  # type: ignore[index]
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny", messages=_user("x"), response_format=fmt)
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")
    assert (await client.models.retrieve("tiny")).id == "tiny"


async def test_tokenizer_endpoints_and_version(cluster: UpProcess) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{cluster.url}/tokenize", json={"model": "tiny", "prompt": "hi"}) as resp:
            tokens = (await resp.json())["tokens"]
        assert tokens[-2:] == [ord("h"), ord("i")]
        async with http.post(f"{cluster.url}/detokenize", json={"model": "tiny", "tokens": tokens}) as resp:
            assert (await resp.json())["prompt"] == "hi"
        chat = {"model": "tiny", "messages": _user("hi")}
        async with http.post(f"{cluster.url}/tokenize", json=chat) as resp:
            assert (await resp.json())["count"] > len(tokens)
        async with http.post(f"{cluster.url}/detokenize", json={"tokens": [10**6]}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"
        async with http.get(f"{cluster.url}/version") as resp:
            assert (await resp.json())["version"]

"""OpenAI request validation: every bad input names its parameter."""

from __future__ import annotations

from typing import Any

import pytest

from services.router.requests import parse_chat, parse_completion
from shared.errors import InvalidRequestError

OK_COMPLETION = {"model": "tiny", "prompt": "hi"}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": 3}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": None}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_completion_rejects(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({**OK_COMPLETION, **patch})
    assert err.value.param == param and err.value.http_status == 400


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ],
)
def test_chat_rejects(messages: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({**OK_CHAT, "messages": messages})
    assert err.value.param == param


def test_defaults_and_extensions() -> None:
    req = parse_completion({**OK_COMPLETION, "ignore_eos": True, "min_tokens": 3, "stop": "x"}, "sess-1")
    assert (req.max_tokens, req.temperature, req.stop, req.ignore_eos, req.min_tokens, req.session_id) == (
        16,
        1.0,
        ["x"],
        True,
        3,
        "sess-1",
    )
    chat = parse_chat(
        {
            **OK_CHAT,
            "max_completion_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u",
        }
    )
    assert (chat.max_tokens, chat.include_usage, chat.session_id) == (7, True, "u")
    assert parse_chat(OK_CHAT).max_tokens is None  # chat: until the context is full
    assert parse_completion({**OK_COMPLETION, "prompt": [[1, 2, 3]]}).prompt_token_ids == [1, 2, 3]


def test_text_parts_are_joined_and_developer_is_system() -> None:
    req = parse_chat(
        {
            **OK_CHAT,
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        }
    )
    assert req.messages == [{"role": "system", "content": "ab"}]


def test_sampling_parameters_are_parsed() -> None:
    body = {
        **OK_COMPLETION,
        "n": 3,
        "best_of": 3,
        "top_k": -1,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "presence_penalty": -0.5,
        "frequency_penalty": 0.5,
        "logit_bias": {"17": -100, "3": 2.5},
        "logprobs": 2,
    }
    req = parse_completion(body)
    assert (req.n, req.top_k, req.min_p, req.repetition_penalty) == (3, 0, 0.1, 1.2)
    assert (req.presence_penalty, req.frequency_penalty, req.logprobs, req.echo) == (-0.5, 0.5, 2, False)
    assert parse_completion({**OK_COMPLETION, "echo": True}).echo
    assert req.logit_bias == {17: -100.0, 3: 2.5}
    chat = parse_chat({**OK_CHAT, "logprobs": True, "top_logprobs": 4})
    assert chat.logprobs == 4 and parse_chat({**OK_CHAT, "logprobs": True}).logprobs == 0
    assert parse_chat(OK_CHAT).logprobs == -1
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({**OK_CHAT, "top_logprobs": 2})  # without logprobs: true
    assert err.value.param == "top_logprobs"


def test_tools_and_tool_messages_are_parsed() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    req = parse_chat({**OK_CHAT, "messages": messages, "tools": [tool], "tool_choice": "required"})
    assert req.tools is not None and req.tools.choice == "required" and req.tools.is_forced
    assert req.messages is not None and req.messages[1]["tool_calls"][0]["arguments"] == {"x": 1}
    assert req.messages[2]["tool_call_id"] == "c1"
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_chat({**OK_CHAT, "tools": [tool], "tool_choice": named}).tools.choice == "f"  # type: ignore[union-attr]
    for bad, param in (
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [tool, tool]}, "tools"),
        ({"tools": [tool], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            parse_chat({**OK_CHAT, **bad})
        assert err.value.param == param, bad

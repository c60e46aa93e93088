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
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 3}, "logprobs"),
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

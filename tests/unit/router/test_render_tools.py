"""Tool calls in responses: the non-streamed message is what the stream's deltas add up to, a call cut off
by max_tokens included (OpenAI's shape: its arguments so far, finish_reason "length"), never the raw
`<tool_call>` markup."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from services.router.core import Piece, Usage
from services.router.render import RenderOptions, ResponseRenderer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def _renderer(forced: bool) -> ResponseRenderer:
    options = RenderOptions("chat", "chatcmpl-1", "m", parses_tool_calls=True, is_tool_forced=forced)
    return ResponseRenderer(options)


def _streamed(text: str, finish: str, forced: bool, step: int = 3) -> tuple[dict[str, Any], list[Any]]:
    """Feed `text` in pieces of `step` characters; the content, calls and finish the deltas add up to."""
    renderer = _renderer(forced)
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    deltas: list[Any] = []
    finish_reason = None
    for i, part in enumerate(pieces):
        last = i == len(pieces) - 1
        for chunk in renderer.piece_chunks(0, Piece(part, [1], finish if last else None)):
            [choice] = orjson.loads(chunk.removeprefix(b"data: "))["choices"]
            deltas.append(choice["delta"])
            finish_reason = choice["finish_reason"] or finish_reason
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            entry["id"] = call.get("id", entry["id"])
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"].get("arguments", "")
    message = {"content": content or None, "calls": [(c["name"], c["arguments"]) for c in calls.values()]}
    return {"message": message, "finish": finish_reason}, deltas


def _whole(text: str, finish: str, forced: bool) -> dict[str, Any]:
    renderer = _renderer(forced)
    renderer.add_piece(0, Piece(text, [1], finish))
    [choice] = renderer.final(Usage())["choices"]
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return {"message": {"content": message["content"], "calls": calls}, "finish": choice["finish_reason"]}


@pytest.mark.parametrize(
    ("text", "finish", "arguments", "reason"),
    [
        (CALL, "stop", '{"city": "Paris", "unit": "c"}', "tool_calls"),
        # max_tokens ran out inside the closing tag, just after the call's brace, inside the arguments
        (CALL[: CALL.index("</tool") + 4], "length", '{"city": "Paris", "unit": "c"}', "length"),
        (CALL[: CALL.index("}}") + 2], "length", '{"city": "Paris", "unit": "c"}', "length"),
        (CALL[: CALL.index("}}") + 1], "length", '{"city": "Paris", "unit": "c"}', "length"),
        (CALL[: CALL.index('"c"}')], "length", '{"city": "Paris", "unit": ', "length"),
    ],
)
@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_call_streamed_and_not_adds_up_to_the_same_message(
    text: str, finish: str, arguments: str, reason: str, forced: bool, step: int
) -> None:
    whole = _whole(text, finish, forced)
    streamed, _ = _streamed(text, finish, forced, step)
    expected = {"message": {"content": None, "calls": [("get_weather", arguments)]}, "finish": reason}
    assert whole == expected and streamed == expected
    if reason == "tool_calls":
        assert json.loads(arguments) == {"city": "Paris", "unit": "c"}


def test_a_call_whose_name_was_not_reached_yields_no_markup_as_content() -> None:
    text = '<tool_call>\n{"na'
    assert _whole(text, "length", True) == {"message": {"content": "", "calls": []}, "finish": "length"}
    streamed, _ = _streamed(text, "length", True)
    assert streamed == {"message": {"content": None, "calls": []}, "finish": "length"}


def test_text_answers_under_auto_are_content_and_two_calls_are_two() -> None:
    text = "It is sunny."
    expected = {"message": {"content": text, "calls": []}, "finish": "stop"}
    assert _whole(text, "stop", False) == expected and _streamed(text, "stop", False)[0] == expected
    two = CALL + "\n" + CALL.replace("Paris", "Oslo")
    whole = _whole(two, "stop", False)
    assert [json.loads(a)["city"] for _, a in whole["message"]["calls"]] == ["Paris", "Oslo"]
    assert whole == _streamed(two, "stop", False, 5)[0] and whole["finish"] == "tool_calls"


def test_tokens_the_parser_holds_back_send_no_empty_chunks() -> None:
    """The call's header (`<tool_call>\\n{"name": ...`) is held until the name is known: one chunk per
    event, not an empty delta per token."""
    _, deltas = _streamed(CALL, "stop", True, step=1)
    assert all(d for d in deltas[:-1]), [d for d in deltas if not d]
    assert len([d for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]) == 1

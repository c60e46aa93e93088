"""OpenAI response objects for one request: JSON bodies, SSE chunks, log-probabilities and tool calls.

Every choice of the request (`n`) has a `ChoiceState`: its text so far, its token ids, its tool-call parser.
A middle chunk of plain text (no log-probabilities, no tool parsing, token ids already sent) is built from
constant byte strings: the per-token hot path of streaming.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.router.core import Piece, Usage
from services.router.tools import ToolCallParser, ToolEvent

_NO_FINISH = b',"logprobs":null,"finish_reason":null'


@dataclass(slots=True)
class ChoiceState:
    index: int
    parser: ToolCallParser | None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    num_chars: int = 0  # characters of text so far (completions' text_offset)
    finish_reason: str | None = None


@dataclass(slots=True)
class RenderOptions:
    endpoint: str  # "completions" | "chat"
    request_id: str
    model: str
    n: int = 1
    include_usage: bool = False
    prompt_token_ids: list[int] | None = None  # set when the client asked for token ids
    tokenizer: Any = None  # for log-probability token strings
    wants_logprobs: bool = False
    parses_tool_calls: bool = False
    is_tool_forced: bool = False
    echo: str = ""  # completions with echo: the prompt text


class ResponseRenderer:
    """Builds the OpenAI objects of one request."""

    def __init__(self, options: RenderOptions) -> None:
        self.o = options
        self.is_chat = options.endpoint == "chat"
        self.created = int(time.time())
        self.has_sent_prompt_ids = False
        self.choices = [
            ChoiceState(i, ToolCallParser(options.is_tool_forced) if options.parses_tool_calls else None)
            for i in range(options.n)
        ]
        self._obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        envelope = orjson.dumps(self._envelope(self._obj))[:-1]  # without the closing brace
        self._chunk_head = b"data: " + envelope + b',"choices":[{"index":'
        self._chunk_tail = b"}]" + (b',"usage":null' if options.include_usage else b"") + b"}\n\n"
        self._is_plain = not (options.wants_logprobs or options.parses_tool_calls)

    def _envelope(self, obj_type: str) -> dict[str, Any]:
        return {"id": self.o.request_id, "object": obj_type, "created": self.created, "model": self.o.model}

    @staticmethod
    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    # ------------------------------------------------------------------------------------------ stream

    def first_chunks(self) -> list[bytes]:
        """What goes out before any token: chat's role delta per choice, completions' echoed prompt."""
        if self.is_chat:
            role = {"role": "assistant", "content": ""}
            return [self._chunk(c, role, None, None, Piece("", [])) for c in self.choices]
        if self.o.echo:
            out = []
            for c in self.choices:
                c.num_chars = len(self.o.echo)
                out.append(self._chunk(c, {"text": self.o.echo}, None, None))
            return out
        return []

    def piece_chunks(self, index: int, piece: Piece) -> list[bytes]:
        """The SSE chunks of one piece of choice `index`."""
        choice = self.choices[index]
        choice.token_ids += piece.token_ids
        finish = self._finish(choice, piece.finish_reason)
        wants_ids = (self.o.prompt_token_ids is not None or self.o.wants_logprobs) and bool(piece.token_ids)
        if not (piece.text or finish or wants_ids):
            return []
        if (
            self._is_plain
            and finish is None
            and (self.o.prompt_token_ids is None or self.has_sent_prompt_ids)
        ):
            return [self._fast_chunk(index, piece.text, piece.token_ids)]
        logprobs = self._logprobs(choice, piece) if self.o.wants_logprobs else None
        if choice.parser is None:
            body = {"content": piece.text} if self.is_chat else {"text": piece.text}
            return [
                self._chunk(choice, body if piece.text or not self.is_chat else {}, logprobs, finish, piece)
            ]
        events = choice.parser.feed(piece.text, is_final=finish is not None)
        if not events and finish is None and logprobs is None and not wants_ids:
            return []  # text the parser holds back (a call's header, a tag): nothing to say yet
        deltas = [_event_delta(e) for e in events] or [{}]
        chunks = [self._chunk(choice, d, None, None) for d in deltas[:-1]]
        return [*chunks, self._chunk(choice, deltas[-1], logprobs, finish, piece)]

    def _finish(self, choice: ChoiceState, reason: str | None) -> str | None:
        if reason is not None and choice.parser is not None and choice.parser.calls and reason == "stop":
            reason = "tool_calls"
        choice.finish_reason = reason or choice.finish_reason
        return reason

    def _fast_chunk(self, index: int, text: str, token_ids: list[int]) -> bytes:
        if self.is_chat:
            body = b'"delta":{"content":' + orjson.dumps(text) + b"}" if text else b'"delta":{}'
        else:
            body = b'"text":' + orjson.dumps(text)
        ids = b',"token_ids":' + orjson.dumps(token_ids) if self.o.prompt_token_ids is not None else b""
        head = self._chunk_head + str(index).encode() + b","
        return b"".join((head, body, _NO_FINISH, ids, self._chunk_tail))

    def _chunk(
        self,
        choice: ChoiceState,
        body: dict[str, Any],
        logprobs: Any,
        finish: str | None,
        piece: Piece | None = None,
    ) -> bytes:
        out = self._envelope(self._obj)
        entry: dict[str, Any] = {"index": choice.index}
        entry.update({"delta": body} if self.is_chat else body)
        if not self.is_chat and "text" not in entry:
            entry["text"] = ""
        entry["logprobs"] = logprobs
        entry["finish_reason"] = finish
        out["choices"] = [entry]
        if piece is not None or (not self.is_chat and self.o.echo):
            self._add_token_ids(out, piece.token_ids if piece else [])
        if self.o.include_usage:
            out["usage"] = None
        return self.sse(out)

    def _add_token_ids(self, out: dict[str, Any], token_ids: list[int]) -> None:
        if self.o.prompt_token_ids is None:
            return
        out["choices"][0]["token_ids"] = token_ids
        if not self.has_sent_prompt_ids:
            out["prompt_token_ids"] = self.o.prompt_token_ids
            self.has_sent_prompt_ids = True  # once per response

    def usage_chunk(self, usage: Usage) -> bytes:
        out = self._envelope(self._obj)
        out["choices"] = []
        out["usage"] = usage_body(usage)
        return self.sse(out)

    # ------------------------------------------------------------------------------------ log-probs

    def _logprobs(self, choice: ChoiceState, piece: Piece) -> Any:
        entries = piece.logprobs[: len(piece.token_ids)]
        choice.logprobs += entries
        return self._logprobs_object(choice, piece.token_ids, entries)

    def _logprobs_object(self, choice: ChoiceState, token_ids: list[int], entries: list[Any]) -> Any:
        token = self.o.tokenizer.token_text
        if self.is_chat:
            content = [
                {
                    **_lp(token(t), lp),
                    "top_logprobs": [_lp(token(i), v) for i, v in zip(ids, lps, strict=True)],
                }
                for t, (lp, ids, lps) in zip(token_ids, entries, strict=False)
            ]
            return {"content": content, "refusal": None}
        tokens = [token(t) for t in token_ids[: len(entries)]]
        offsets = []
        for text in tokens:
            offsets.append(choice.num_chars)
            choice.num_chars += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e[0] for e in entries],
            "top_logprobs": [{token(i): v for i, v in zip(e[1], e[2], strict=True)} for e in entries],
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------------------------- JSON body

    def final(self, usage: Usage) -> dict[str, Any]:
        out = self._envelope("chat.completion" if self.is_chat else "text_completion")
        out["choices"] = [self._final_choice(c) for c in self.choices]
        if self.o.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.o.prompt_token_ids
        out["usage"] = usage_body(usage)
        return out

    def add_piece(self, index: int, piece: Piece) -> None:
        """Non-streamed: accumulate a piece of choice `index`."""
        choice = self.choices[index]
        choice.text.append(piece.text)
        choice.token_ids += piece.token_ids
        choice.logprobs += piece.logprobs[: len(piece.token_ids)]
        choice.finish_reason = piece.finish_reason or choice.finish_reason

    def _final_choice(self, choice: ChoiceState) -> dict[str, Any]:
        text = "".join(choice.text)
        logprobs = None
        if self.o.wants_logprobs:
            choice.num_chars = len(self.o.echo)
            logprobs = self._logprobs_object(choice, choice.token_ids, choice.logprobs)
        finish = choice.finish_reason or "stop"
        entry: dict[str, Any] = {"index": choice.index}
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if choice.parser is not None:  # what the stream's deltas add up to
                events = choice.parser.feed(text, is_final=True)
                message["content"] = "".join(e.content for e in events)
                if choice.parser.calls:
                    message = {"role": "assistant", "content": message["content"] or None}
                    message["tool_calls"] = _calls(choice)
                    finish = "tool_calls" if finish == "stop" else finish
            entry["message"] = message
        else:
            entry["text"] = self.o.echo + text
        entry["logprobs"] = logprobs
        entry["finish_reason"] = finish
        if self.o.prompt_token_ids is not None:
            entry["token_ids"] = choice.token_ids
        return entry


def _lp(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _event_delta(event: ToolEvent) -> dict[str, Any]:
    if event.content:
        return {"content": event.content}
    call: dict[str, Any] = {"index": event.index}
    if event.name:
        call.update(
            {"id": event.call_id, "type": "function", "function": {"name": event.name, "arguments": ""}}
        )
    else:
        call["function"] = {"arguments": event.arguments}
    return {"tool_calls": [call]}


def _calls(choice: ChoiceState) -> list[dict[str, Any]]:
    assert choice.parser is not None
    return [  # a call cut off by max_tokens has the arguments written so far (finish_reason "length")
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in choice.parser.calls
    ]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }

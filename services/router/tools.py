"""Function calling (pure apart from grammar building): `tools` / `tool_choice` parsing, the prompt, the
grammar that forces well-formed calls, and the parser that turns generated text into OpenAI `tool_calls`.

The model calls functions in the Hermes format (what Qwen2 and most tool-tuned models emit):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. When the model's chat template renders `tools` itself, it gets them (and assistant
`tool_calls` with parsed arguments); otherwise kvpath writes the tools into the system message
(`TOOLS_PROMPT`) and assistant calls into the assistant text, in the format above. Whenever calls are
possible (`tool_choice` auto, required or a named function), decoding is constrained by a grammar: with
`auto` the answer is either text that does not start with `<` or a sequence of calls whose JSON matches one
tool's schema; with `required` or a named function it must be calls. So every parsed call is valid JSON for
its function's parameters.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpu.grammar import JSON_OPTIONS, lark_grammar
from shared.errors import InvalidRequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
TOOLS_PROMPT = (
    "You may call these functions (JSON schemas):\n<tools>\n{tools}\n</tools>\n"
    "To call functions, answer with one or more blocks\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>\n'
    "and nothing else; otherwise answer in plain text."
)
_HEADER = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
_ARGS_END = "}" + CALL_CLOSE
JSON_OPTIONS_SCHEMA = {"x-guidance": JSON_OPTIONS}  # llguidance's JSON options inside a Lark %json


@dataclass(slots=True)
class ToolSpec:
    functions: list[dict[str, Any]]  # {"name", "description", "parameters"}
    choice: str = "auto"  # auto | none | required | <function name>
    is_parallel: bool = True

    @property
    def can_call(self) -> bool:
        return self.choice != "none"

    @property
    def is_forced(self) -> bool:
        return self.choice not in ("auto", "none")


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise _bad("'tools' must be a list of at most 128 functions", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _bad("'tools' has two functions of the same name", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    return ToolSpec(functions, _choice(choice, names), parallel)


def _function(tool: Any, index: int) -> dict[str, Any]:
    param = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise _bad(f"{param} must be {{'type': 'function', 'function': {{'name': ...}}}}", param)
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise _bad(f"{param}.function.parameters must be a JSON schema object", param)
    out = {"name": function["name"], "parameters": parameters}
    if isinstance(function.get("description"), str):
        out["description"] = function["description"]
    return out


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return str(choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice_type := (choice.get("type") if isinstance(choice, dict) else None):
        if choice_type == "function" and name in names:
            return str(name)
    raise _bad(f"'tool_choice' must be auto, none, required or one of the functions {names}", "tool_choice")


def tool_fields(msg: dict[str, Any], role: str, param: str) -> dict[str, Any]:
    """The tool parts of a history message: an assistant's `tool_calls`, a tool result's `tool_call_id`."""
    out: dict[str, Any] = {}
    calls = msg.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise _bad(f"{param}.tool_calls must be a list", f"{param}.tool_calls")
        out["tool_calls"] = [_history_call(c, f"{param}.tool_calls") for c in calls]
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{param}.tool_call_id must be a string", f"{param}.tool_call_id")
        out["tool_call_id"] = call_id or ""
    return out


def _history_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(f"{param}: each call needs function.name", param)
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments  # the model's own malformed text, kept as it was
    return {"id": call.get("id", ""), "type": "function", "name": function["name"], "arguments": parsed}


# ------------------------------------------------------------------------------------------ the prompt


def template_messages(
    messages: list[dict[str, Any]], spec: ToolSpec | None, template_renders_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: as they are when the template renders tools, else with
    the tools in the system message and calls in the assistant text (the documented TOOLS_PROMPT)."""
    if template_renders_tools:
        tools = [{"type": "function", "function": f} for f in spec.functions] if spec else None
        rendered = [_native_calls(m) for m in messages]
        return rendered, tools
    out = [_text_calls(m) for m in messages]
    if spec is not None:
        listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in spec.functions)
        prompt = TOOLS_PROMPT.format(tools=listing)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    native = [{"type": "function", "id": c["id"], "function": _call_json(c)} for c in calls]
    return {**message, "tool_calls": native}


def _text_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    base = {k: v for k, v in message.items() if k in ("role", "content")}
    if not calls:
        return base
    blocks = "\n".join(CALL_OPEN + json.dumps(_call_json(c), ensure_ascii=False) + CALL_CLOSE for c in calls)
    return {**base, "content": (base["content"] + "\n" if base["content"] else "") + blocks}


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["name"], "arguments": call["arguments"]}


# ----------------------------------------------------------------------------------------- the grammar


def tool_grammar(spec: ToolSpec) -> str | None:
    """The grammar of the answers the choice allows (None: `none`, unconstrained text)."""
    if not spec.can_call:
        return None
    functions = spec.functions if not spec.is_forced else [f for f in spec.functions if _wanted(f, spec)]
    schema = {
        **JSON_OPTIONS_SCHEMA,
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ],
    }
    # a named function is called once (OpenAI's forced function); otherwise parallel_tool_calls decides
    calls = "call+" if spec.is_parallel and spec.choice in ("auto", "required") else "call"
    start = f"start: {calls}" if spec.is_forced else f"start: TEXT | {calls}"
    lark = (
        f"{start}\n"
        f'call: {json.dumps(CALL_OPEN)} json_call {json.dumps(CALL_CLOSE)} "\\n"?\n'
        f"json_call: %json {json.dumps(schema)}\n"
        "TEXT: /[^<][\\s\\S]*/\n"
    )
    return lark_grammar(lark)


def _wanted(function: dict[str, Any], spec: ToolSpec) -> bool:
    return spec.choice == "required" or function["name"] == spec.choice


# ------------------------------------------------------------------------------------------- the output


@dataclass(slots=True)
class ToolEvent:
    """A piece of the answer: text (`content`), a call's start (`name` set, `index`, `call_id`), or a
    piece of a call's arguments (`arguments`)."""

    content: str = ""
    index: int = -1
    call_id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(slots=True)
class ToolCallParser:
    """Turns generated text into content or calls, as it streams. With `is_forced` the answer is calls."""

    is_forced: bool
    text: str = ""
    pos: int = 0  # text before this is turned into events
    mode: str = "start"  # start | content | calls | args
    num_calls: int = 0
    calls: list[dict[str, str]] = field(default_factory=list)  # {"id", "name", "arguments"}

    def feed(self, text: str, *, is_final: bool = False) -> list[ToolEvent]:
        self.text += text
        events: list[ToolEvent] = []
        while self._step(events, is_final):
            pass
        return events

    def _step(self, events: list[ToolEvent], is_final: bool) -> bool:
        rest = self.text[self.pos :]
        if self.mode == "start":
            if rest.startswith(CALL_OPEN.strip()) or self.is_forced:
                self.mode = "calls"
                return True
            if CALL_OPEN.startswith(rest) and not is_final:
                return False  # may still become a call
            self.mode = "content"
            return True
        if self.mode == "content":
            if rest:
                events.append(ToolEvent(content=rest))
                self.pos = len(self.text)
            return False
        if self.mode == "calls":
            return self._header(rest, events)
        return self._arguments(rest, events, is_final)

    def _header(self, rest: str, events: list[ToolEvent]) -> bool:
        start = rest.find(CALL_OPEN)
        match = _HEADER.match(rest, start + len(CALL_OPEN)) if start >= 0 else None
        if match is None:
            return False
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": json.loads(match.group(1)), "arguments": ""}
        self.calls.append(call)
        events.append(ToolEvent(index=len(self.calls) - 1, call_id=call["id"], name=call["name"]))
        self.pos += match.end()
        self.mode = "args"
        return True

    def _arguments(self, rest: str, events: list[ToolEvent], is_final: bool) -> bool:
        end = rest.find(_ARGS_END)
        done = end >= 0
        upto = (
            end
            if done
            else (
                _cut_end(self.calls[-1]["arguments"], rest)
                if is_final
                else max(0, len(rest) - len(_ARGS_END))
            )
        )
        if upto:
            piece = rest[:upto]
            self.calls[-1]["arguments"] += piece
            events.append(ToolEvent(index=len(self.calls) - 1, arguments=piece))
            self.pos += upto
        if done:
            self.pos += len(_ARGS_END)
            self.mode = "calls"
        return done


def _cut_end(sent: str, rest: str) -> int:
    """Where in `rest` the arguments of a call cut off by the end of the answer (max_tokens) end, `sent`
    being those already passed on: before the part of `}\n</tool_call>` (the call object's brace, then its
    closing tag) that follows arguments that are a whole JSON value; at the end when they are not (cut
    inside them)."""
    for size in range(len(_ARGS_END) - 1, 0, -1):
        if rest.endswith(_ARGS_END[:size]) and _is_json(sent + rest[:-size]):
            return len(rest) - size
    return len(rest)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True

"""Chat templates: find a checkpoint's jinja2 template and render OpenAI-style messages with it.

Rendering runs in jinja2's immutable sandbox with the helpers HF templates expect (`raise_exception`,
`strftime_now`, `tojson`). Anything a client sent that the template cannot render becomes an
`InvalidRequestError`, never a crash.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

from shared.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


def find_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """tokenizer_config.json `chat_template` (a string or a list of named ones), else chat_template.jinja."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str) and template:
        return template
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        value = json.loads(json_file.read_text()).get("chat_template")
        return value if isinstance(value, str) else None
    return None


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check roles and flatten text-part lists to strings; raise InvalidRequestError otherwise."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}", param="messages"
            )
        out.append({**message, "content": _content_text(message.get("content"), i)})
    return out


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts are supported", param="messages"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts", param="messages"
    )


def render(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **special: Any,
) -> str:
    """`tools` and `documents` are always passed, None when absent, as transformers does: templates test
    `tools is not none` and pipe them through `tojson`."""
    import jinja2

    try:
        compiled = _compile(template)
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            **special,
        )
    except _TemplateRaised as exc:
        raise InvalidRequestError(f"chat template rejected the messages: {exc}", param="messages") from None
    except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
        raise InvalidRequestError(f"cannot render the chat template: {exc}", param="messages") from None


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)

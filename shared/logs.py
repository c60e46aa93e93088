"""Logging setup: plain or JSON lines, with `key=value` context such as request ids.

Request ids: a line about a request carries its id as a `request_id` field in JSON logs. Code that handles
one request in a task of its own calls `bind_request_id` (the router's HTTP handler); code that handles a
request inline in a shared task wraps it in `request_context` (bus handlers); tasks created inside inherit
the id. Lines logged elsewhere (the engine's step loop) pass `extra={"request_id": ...}`.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvpath_request_id", default="")


def bind_request_id(request_id: str) -> None:
    """Tag every later log line of the current task (and the tasks it creates) with `request_id`."""
    REQUEST_ID.set(request_id)


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Tag the log lines of this block (and of tasks created in it) with `request_id`."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra={...}` fields (request_id, ...) become top-level keys, and the
    request id bound to the current context (see `request_context`) is added unless `extra` names one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "service": self.service,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value
        if "request_id" not in out:
            request_id = REQUEST_ID.get()
            if request_id:
                out["request_id"] = request_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(service: str, *, level: str = "INFO", as_json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter(service))
    else:
        fmt = logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("nats").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

"""JSON Lines reading with errors that point at the offending line and field."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from loadgen.trace import TraceFormatError


class LineReader:
    """Typed field access on one parsed line; every failure raises `TraceFormatError` naming file:line."""

    __slots__ = ("line", "obj", "path")

    def __init__(self, path: str, line: int, obj: dict[str, Any]) -> None:
        self.path = path
        self.line = line
        self.obj = obj

    def fail(self, message: str, param: str | None = None) -> TraceFormatError:
        return TraceFormatError(message, path=self.path, line=self.line, param=param)

    def has(self, key: str) -> bool:
        return key in self.obj and self.obj[key] is not None

    def int_field(
        self, key: str, *, minimum: int = 0, where: str = "", obj: dict[str, Any] | None = None
    ) -> int:
        value = (self.obj if obj is None else obj).get(key)
        if value is None:
            raise self.fail(f"{where}missing field {key!r}", key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{where}field {key!r} must be an integer, got {value!r}", key)
        if value < minimum:
            raise self.fail(f"{where}field {key!r} must be >= {minimum}, got {value}", key)
        return value

    def float_field(
        self, key: str, *, default: float | None = None, where: str = "", obj: dict[str, Any] | None = None
    ) -> float:
        value = (self.obj if obj is None else obj).get(key)
        if value is None:
            if default is None:
                raise self.fail(f"{where}missing field {key!r}", key)
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(f"{where}field {key!r} must be a number, got {value!r}", key)
        if value < 0:
            raise self.fail(f"{where}field {key!r} must be >= 0, got {value}", key)
        return float(value)

    def str_field(self, key: str, *, default: str | None = None) -> str:
        value = self.obj.get(key)
        if value is None:
            if default is None:
                raise self.fail(f"missing field {key!r}", key)
            return default
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or not value:
            raise self.fail(f"field {key!r} must be a non-empty string, got {value!r}", key)
        return value

    def list_field(self, key: str, *, where: str = "", obj: dict[str, Any] | None = None) -> list[Any]:
        value = (self.obj if obj is None else obj).get(key)
        if value is None:
            raise self.fail(f"{where}missing field {key!r}", key)
        if not isinstance(value, list):
            raise self.fail(f"{where}field {key!r} must be a list, got {type(value).__name__}", key)
        return value

    def int_list(self, key: str, *, where: str = "", obj: dict[str, Any] | None = None) -> tuple[int, ...]:
        items = self.list_field(key, where=where, obj=obj)
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise self.fail(f"{where}field {key!r}[{i}] must be an integer >= 0, got {item!r}", key)
        return tuple(items)


def read_lines(path: str | Path) -> Iterator[LineReader]:
    """Each non-blank line of `path` as a `LineReader`; a line that is not a JSON object is an error."""
    name = str(path)
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace: {exc.strerror or exc}", path=name) from exc
    with handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise TraceFormatError(f"not valid JSON: {exc}", path=name, line=number) from None
            if not isinstance(obj, dict):
                raise TraceFormatError(
                    f"each line must be a JSON object, got {type(obj).__name__}", path=name, line=number
                )
            yield LineReader(name, number, obj)


def first_object(path: str | Path) -> dict[str, Any] | None:
    """The first JSON object of a JSONL file (format detection), or None when the file is empty."""
    for reader in read_lines(path):
        return reader.obj
    return None


def write_lines(path: str | Path, objects: Iterator[dict[str, Any]] | list[dict[str, Any]]) -> int:
    count = 0
    with open(path, "wb") as out:
        for obj in objects:
            out.write(orjson.dumps(obj))
            out.write(b"\n")
            count += 1
    return count

"""shared.logs: JSON lines carry the request id bound to the context; plain logs as before."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator

import orjson
import pytest

from shared import logs


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("svc"))
    logger = logging.getLogger("kvpath.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


def test_request_context_tags_lines_and_resets(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.info("before")
    with logs.request_context("req-1"):
        logger.info("inside %s", "x")
        with logs.request_context("req-2"):
            logger.warning("nested")
        logger.info("inside again")
    logger.info("after")
    out = lines(stream)
    assert [line.get("request_id") for line in out] == [None, "req-1", "req-2", "req-1", None]
    assert out[1]["msg"] == "inside x" and out[1]["service"] == "svc" and out[1]["level"] == "INFO"


def test_extra_request_id_wins_over_the_context(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    with logs.request_context("ctx"):
        logger.info("explicit", extra={"request_id": "explicit", "engine": "e0"})
    (line,) = lines(stream)
    assert line["request_id"] == "explicit" and line["engine"] == "e0"


async def test_tasks_inherit_the_bound_id(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured

    async def handler(request_id: str) -> None:
        logs.bind_request_id(request_id)  # a per-request task binds once, no reset needed
        await asyncio.sleep(0)
        child = asyncio.create_task(asyncio.to_thread(logger.info, "from a thread of a child task"))
        logger.info("handler")
        await child

    await asyncio.gather(handler("a"), handler("b"))
    logger.info("outside")
    got = sorted((line["msg"], line.get("request_id")) for line in lines(stream))
    assert got == [
        ("from a thread of a child task", "a"),
        ("from a thread of a child task", "b"),
        ("handler", "a"),
        ("handler", "b"),
        ("outside", None),
    ]


def test_plain_format_is_unchanged_by_the_context() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("kvpath.test.plain")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with logs.request_context("r"):
            logger.warning("stream failed request_id=%s", "r")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "stream failed request_id=r\n"

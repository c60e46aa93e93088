"""Bus handlers of the router (thin: decode, hand to the core). Hot path: token batches."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from nats.aio.msg import Msg

from services.router.core import RouterCore
from services.router.orphans import OrphanAborts
from shared import telemetry
from shared.errors import ProtocolError
from shared.protocol import LoadReport, TokenBatch, TokenDelta, decode, from_dict

log = logging.getLogger(__name__)


def token_batch_handler(core: RouterCore, orphans: OrphanAborts) -> Callable[[Msg], Awaitable[None]]:
    async def on_tokens(msg: Msg) -> None:
        try:
            batch = decode_token_batch(msg.data)
        except ProtocolError as exc:
            telemetry.BUS_ERRORS.labels("malformed").inc()
            log.warning("malformed token batch subject=%s: %s", msg.subject, exc.message)
            return
        core.on_token_batch(batch)
        if core.streams.unknown:
            unknown, core.streams.unknown = core.streams.unknown, set()
            await orphans.abort(unknown, time.monotonic())

    return on_tokens


def load_report_handler(core: RouterCore) -> Callable[[Msg], Awaitable[None]]:
    async def on_load(msg: Msg) -> None:
        try:
            report = decode(msg.data, LoadReport)
        except ProtocolError as exc:
            telemetry.BUS_ERRORS.labels("malformed").inc()
            log.warning("malformed load report subject=%s: %s", msg.subject, exc.message)
            return
        core.on_load_report(report)

    return on_load


# ------------------------------------------------------------------------------- token batch decoding


def decode_token_batch(data: bytes) -> TokenBatch:
    """`decode(data, TokenBatch)`, about 4x faster for the shape engines send.

    The fast path checks the same types as the codec's validation but inline; anything it does not
    recognise (a wrong type, a missing field, a bool where an int belongs) goes through the generic
    validating decoder, so the result or the `ProtocolError` is exactly the codec's.
    """
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return decode(data, TokenBatch)  # raises the codec's ProtocolError
    batch = _fast_token_batch(obj)
    return batch if batch is not None else from_dict(obj, TokenBatch)


def _fast_token_batch(obj: Any) -> TokenBatch | None:
    if type(obj) is not dict or obj.get("kind") != TokenBatch.KIND:
        return None
    version, engine_id, step, raw = obj.get("v"), obj.get("engine_id"), obj.get("step"), obj.get("deltas")
    if type(version) is not int or version != TokenBatch.VERSION:
        return None
    if type(engine_id) is not str or type(step) is not int or type(raw) is not list:
        return None
    deltas = []
    for item in raw:
        delta = _fast_delta(item)
        if delta is None:
            return None
        deltas.append(delta)
    return TokenBatch(engine_id=engine_id, step=step, deltas=deltas)


def _fast_delta(d: Any) -> TokenDelta | None:
    if type(d) is not dict:
        return None
    get = d.get
    request_id, seq, token_ids, finish = get("request_id"), get("seq"), get("token_ids"), get("finish_reason")
    prompt, cached, handoff = get("prompt_tokens", 0), get("cached_tokens", 0), get("handoff", False)
    code, message = get("error_code", ""), get("error_message", "")
    if (
        type(request_id) is not str
        or type(seq) is not int
        or type(token_ids) is not list
        or (finish is not None and type(finish) is not str)
        or type(prompt) is not int
        or type(cached) is not int
        or type(code) is not str
        or type(message) is not str
        or type(handoff) is not bool
    ):
        return None
    for token in token_ids:
        if type(token) is not int:
            return None
    if "logprobs" in d or "error_engine" in d:
        return None  # log-probabilities (nested lists) and engine failures go to the validating decoder
    timings = _timings(d["timings"]) if "timings" in d else {}
    if timings is None:
        return None
    return TokenDelta(
        request_id=request_id,
        seq=seq,
        token_ids=token_ids,
        finish_reason=finish,
        prompt_tokens=prompt,
        cached_tokens=cached,
        error_code=code,
        error_message=message,
        timings=timings,
        handoff=handoff,
    )


def _timings(value: Any) -> dict[str, float] | None:
    if type(value) is not dict:
        return None
    if not value:
        return {}  # every delta but a request's first
    out = {}
    for key, seconds in value.items():
        if type(key) is not str or type(seconds) not in (int, float):
            return None
        out[key] = float(seconds)
    return out

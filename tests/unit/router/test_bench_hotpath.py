"""The router hot-path changes made for `bench router` keep behaviour: the fast TokenBatch decoder gives
exactly the codec's result or error, and a stream's deadline still fires while it waits for tokens."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
import pytest

from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.handlers import decode_token_batch
from shared.bus import Bus
from shared.errors import DeadlineExceededError, ProtocolError
from shared.protocol import TokenBatch, TokenDelta, decode, encode


def _random_batch(rng: random.Random) -> TokenBatch:
    deltas = []
    for i in range(rng.randrange(0, 6)):
        delta = TokenDelta(
            request_id=f"cmpl-{i}",
            seq=rng.randrange(0, 100),
            token_ids=[rng.randrange(0, 50_000) for _ in range(rng.randrange(0, 4))],
            finish_reason=rng.choice([None, None, "stop", "length", "error"]),
            handoff=rng.random() < 0.2,
        )
        if delta.seq == 0:
            delta.prompt_tokens, delta.cached_tokens = rng.randrange(1, 999), rng.randrange(0, 64)
            delta.timings = {"queue_s": rng.random(), "prefill_s": 1.0}
        if delta.finish_reason == "error":
            delta.error_code, delta.error_message = "engine_failed", "boom"
        deltas.append(delta)
    return TokenBatch(engine_id="engine-0", step=rng.randrange(0, 10**6), deltas=deltas)


def test_fast_decode_equals_the_codec_on_what_engines_send() -> None:
    rng = random.Random(7)
    for _ in range(300):
        data = encode(_random_batch(rng))
        assert decode_token_batch(data) == decode(data, TokenBatch)


def _wire(**delta_changes: Any) -> dict[str, Any]:
    delta = TokenDelta(request_id="r", seq=0, token_ids=[1, 2]).to_dict()
    delta.update(delta_changes)
    return TokenBatch(engine_id="e", step=1, deltas=[]).to_dict() | {"deltas": [delta]}


@pytest.mark.parametrize(
    "obj",
    [
        _wire(seq=True),
        _wire(seq=1.0),
        _wire(token_ids=[1, True]),
        _wire(token_ids=[1, 2.0]),
        _wire(token_ids="12"),
        _wire(request_id=None),
        _wire(finish_reason=3),
        _wire(timings=None),
        _wire(timings={"queue_s": True}),
        _wire(timings={"queue_s": "1"}),
        _wire(handoff=1),
        _wire(prompt_tokens=None),
        {k: v for k, v in _wire().items() if k != "engine_id"},
        _wire() | {"v": True},
        _wire() | {"v": 2},
        _wire() | {"kind": "token_delta"},
        _wire() | {"deltas": [{"seq": 0, "token_ids": []}]},
        _wire() | {"deltas": ["x"]},
        _wire() | {"step": "1"},
        [1, 2],
    ],
)
def test_fast_decode_gives_the_codec_result_for_unusual_input(obj: Any) -> None:
    data = orjson.dumps(obj)
    try:
        expected: TokenBatch | str = decode(data, TokenBatch)
    except ProtocolError as exc:
        expected = exc.message
    try:
        got: TokenBatch | str = decode_token_batch(data)
    except ProtocolError as exc:
        got = exc.message
    assert got == expected


def test_fast_decode_coerces_and_ignores_like_the_codec() -> None:
    obj = _wire(timings={"queue_s": 1}, extra_field="ignored")
    batch = decode_token_batch(orjson.dumps(obj))
    assert batch == decode(orjson.dumps(obj), TokenBatch)
    assert batch.deltas[0].timings == {"queue_s": 1.0} and type(batch.deltas[0].timings["queue_s"]) is float


def test_non_json_is_the_codecs_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not JSON"):
        decode_token_batch(b"{nope")


async def test_waiting_for_tokens_still_hits_the_request_deadline() -> None:
    core = RouterCore(RouterConfig(request_deadline_s=1.0), Bus("nats://127.0.0.1:1", "t", name="t"), "r")
    stream = core.streams.open("req")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DeadlineExceededError, match="1s deadline"):
        await core._next_deltas(stream, deadline=started + 0.05)
    assert stream.queue.empty()
    stream.queue.put_nowait(TokenDelta(request_id="req", seq=0, token_ids=[5]))
    stream.queue.put_nowait(TokenDelta(request_id="req", seq=1, token_ids=[6], finish_reason="length"))
    deltas = await core._next_deltas(stream, deadline=loop.time() + 5)
    assert [d.token_ids for d in deltas] == [[5], [6]]  # queued deltas are taken together, no wait

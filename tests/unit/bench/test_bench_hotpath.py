"""The router hot-path changes made for `bench router` keep behaviour: the fast TokenBatch decoder gives
exactly the codec's result or error, SSE chunks from prebuilt parts are byte-identical, and a stream's
deadline still fires while it waits for tokens."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from gpu.model_spec import load_model_spec
from gpu.tokenizer import load_tokenizer
from loadgen.bench.load_driver import LoadDriverConfig, LoadDriverEngine
from services.router import handlers
from services.router.config import RouterConfig
from services.router.core import Piece, RouterCore, Usage
from services.router.handlers import decode_token_batch
from services.router.orphans import OrphanAborts
from services.router.prompts import PreparedPrompt
from services.router.render import RenderOptions, ResponseRenderer
from services.router.requests import GenerationRequest
from shared.bus import Bus
from shared.errors import DeadlineExceededError, ProtocolError
from shared.natsserver import NatsServer
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
            delta.error_engine = rng.choice(["", "pe-0"])  # the peer whose loss failed it
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


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("prompt_ids", [None, [3, 4]])
def test_sse_chunks_from_prebuilt_parts_are_byte_identical(
    endpoint: str, include_usage: bool, prompt_ids: list[int] | None
) -> None:
    options = RenderOptions(
        endpoint, "cmpl-1", 'm"odel', include_usage=include_usage, prompt_token_ids=prompt_ids
    )
    fast, slow = ResponseRenderer(options), ResponseRenderer(options)
    slow.created = fast.created
    slow._is_plain = False  # every chunk built as an object and serialized
    assert fast.first_chunks() == slow.first_chunks()
    pieces = [("a", None, [1]), ("", None, [2]), ('q"\\ \u00e9\n\U0001f600', None, [3, 4]), ("", None, [])]
    pieces += [("end", "length", [5])]
    for text, finish, ids in pieces:
        piece = Piece(text, ids, finish)
        assert fast.piece_chunks(0, piece) == slow.piece_chunks(0, piece), (text, finish)


def test_non_json_is_the_codecs_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not JSON"):
        decode_token_batch(b"{nope")


async def test_a_stream_waiting_for_tokens_still_ends_at_its_deadline(
    nats_server: NatsServer, namespace: str
) -> None:
    """Real bus, a load driver at 5 steps/s, a router core with a 0.6 s deadline: tokens flow, then the
    deadline error ends the stream, and the driver gets the abort."""
    common = {"nats_url": nats_server.url, "namespace": namespace}
    driver = LoadDriverEngine(LoadDriverConfig(**common, step_hz=5.0))
    await driver.start()
    bus = Bus(nats_server.url, namespace, name="router-t")
    await bus.connect()
    try:
        core = RouterCore(RouterConfig(**common, request_deadline_s=0.6), bus, "router-t")
        await bus.subscribe_raw(
            bus.subjects.tokens("router-t"), handlers.token_batch_handler(core, OrphanAborts(bus))
        )
        await bus.subscribe_raw(bus.subjects.load_all, handlers.load_report_handler(core))
        await _until(lambda: bool(core.engines.engine_snapshots(64, ("colocated",))))
        tokenizer = load_tokenizer(load_model_spec("tiny", None).model_dir)
        request = GenerationRequest(
            endpoint="completions", model="tiny", prompt_token_ids=[1, 2], max_tokens=99
        )
        prompt = PreparedPrompt(request=request, token_ids=[1, 2], max_tokens=99, tokenizer=tokenizer)
        started = time.monotonic()
        pieces = []
        with pytest.raises(DeadlineExceededError, match="1s deadline"):
            async for piece in core.generate(prompt, "cmpl-deadline", Usage()):
                pieces.append(piece)
        assert pieces and 0.55 < time.monotonic() - started < 5.0
        await _until(lambda: not driver.streams)  # the router aborted the request in the engine
    finally:
        await bus.close()
        await driver.stop()


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)

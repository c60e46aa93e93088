"""The holder's side of grouped route exchanges, driven by hand against a real holder engine process.

The test is the requester: it opens route sessions over NATS with reply extents in its own data-plane
receiver, then writes query groups (shared/protocol/movequery.py) into the holder's query region. One notice
carries several requests' rows and comes back as one notice with each request's partial in its own extent;
each malformed group or item gets an error (the others of its group are still answered) and never a hang."""

from __future__ import annotations

import random
import time
from typing import Any

import aiohttp
import numpy as np
import pytest

from shared.bus import Bus
from shared.hashing import block_hashes
from shared.protocol import Ack, decode, encode
from shared.protocol.movequery import (
    PartialQueries,
    PartialQuery,
    PartialReplies,
    RouteBuffer,
    RouteClose,
    RouteOpen,
    RouteOpened,
)
from shared.transport import KvReceiver, KvSender, TransportConfig
from tests.cluster import Stack, wait_ready
from tests.integration.test_kv_reuse import complete
from tests.integration.test_movequery import BLOCK, DOC_TOKENS, engine_args, until_held

pytestmark = pytest.mark.slow
REPLIES, EXTENT, TIMEOUT_S = "replies", 1 << 16, 5.0
HEADS, HEAD_DIM = 8, 32  # the tiny model: a query token is 8 x 32 fp32 values


async def open_session(
    bus: Bus, rx: KvReceiver, name: str, n: int, chunk_hash: int, fp: str, sender: str
) -> Any:
    reply = RouteBuffer(
        engine_id="test", endpoint=rx.endpoint(), region=REPLIES, offset=n * EXTENT, size_bytes=EXTENT, slot=n
    )
    request = RouteOpen(
        request_id=name,
        chunk_hash=chunk_hash,
        num_blocks=DOC_TOKENS // BLOCK,
        fingerprint=fp,
        query_bytes_per_token=HEADS * HEAD_DIM * 4,
        max_query_tokens=8,
        reply=reply,
        sender_id=sender,
        deadline_unix_s=time.time() + 120,
    )
    opened = await bus.request(bus.subjects.route("engine-0"), request, RouteOpened, timeout_s=TIMEOUT_S)
    return opened.queries, n


def rows(num_tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((num_tokens, HEADS, HEAD_DIM)).astype(np.float32)


async def test_one_notice_carries_a_group_and_each_bad_item_is_refused_alone(
    stack: tuple[Stack, Bus],
) -> None:
    s, bus = stack
    rng = random.Random(3)
    doc = [rng.randrange(3, 250) for _ in range(DOC_TOKENS)]
    s.start("index", "index-0")
    s.start("engine", "engine-0", *engine_args("shm", holds=True))
    s.start("router", "router-0", "--http-port", "0", "--move-query", "route")
    ready = await wait_ready(bus, {"index-0", "engine-0", "router-0"}, s.procs)
    fp = ready["engine-0"].kv_format.fingerprint
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        await complete(http, ready["router-0"].http_url, doc, 2, "doc")
    await until_held(bus, doc, fp)
    chunk_hash = block_hashes(doc, BLOCK, fp)[-1]

    rx = KvReceiver(TransportConfig(backends=["shm"]), receiver_id="test-requester")
    await rx.start()
    rx.register_region(REPLIES, 4 * EXTENT)
    tx = KvSender(TransportConfig(backends=["shm"]), sender_id="test-requester")
    try:
        a = await open_session(bus, rx, "a", 1, chunk_hash, fp, "test-requester")
        b = await open_session(bus, rx, "b", 2, chunk_hash, fp, "test-requester")
        other = await open_session(bus, rx, "other", 3, chunk_hash, fp, "another-requester")
        peer = await tx.connect(a[0].endpoint, timeout_s=TIMEOUT_S)

        async def send(
            items: list[PartialQuery], data: list[tuple[Any, np.ndarray]], meta: bytes = b""
        ) -> Any:
            extents = [(q.offset, memoryview(r).cast("B")) for (q, _), r in data]
            meta = meta or encode(PartialQueries(items=items))
            await peer.write_many(a[0].region, extents, tag=a[0].slot, meta=meta, timeout_s=TIMEOUT_S)
            notice = await rx.wait(REPLIES, a[1], timeout_s=TIMEOUT_S)
            return notice, decode(notice.meta, PartialReplies)

        def query(name: str, layer: int, n: int, step: int = 0) -> PartialQuery:
            return PartialQuery(request_id=name, step=step, layer=layer, num_tokens=n)

        # a group of two: one notice back, each partial in its own extent
        notice, replies = await send([query("a", 0, 1), query("b", 0, 2)], [(a, rows(1, 1)), (b, rows(2, 2))])
        assert not replies.error and [r.error for r in replies.items] == ["", ""]
        assert notice.nbytes == 3 * HEADS * (HEAD_DIM + 2) * 4
        region = rx.region(REPLIES)
        for (_, slot), n in ((a, 1), (b, 2)):
            partial = region.view(slot * EXTENT, n * HEADS * (HEAD_DIM + 2) * 4).view(np.float32)
            packed = partial.reshape(n, HEADS, HEAD_DIM + 2)
            assert np.isfinite(packed).all() and (packed[..., -1] > 0).all()  # l > 0: every key seen

        # refused as a whole: garbled meta, bytes that do not add up, a first item not the lead's
        for items, data, meta, error in (
            ([query("a", 1, 1)], [(a, rows(1, 3))], b"{not json", "malformed message"),
            ([query("a", 1, 2)], [(a, rows(1, 3))], b"", "bytes written"),
            ([query("b", 1, 1)], [(b, rows(1, 3))], b"", "first query"),
        ):
            notice, replies = await send(items, data, meta)
            assert error in replies.error and notice.nbytes == 0

        # refused item by item, the rest of the group answered (and moved on to the next layer)
        items = [query("a", 1, 1), query("other", 0, 1), query("nobody", 0, 1), query("b", 3, 1)]
        data = [(a, rows(1, 4)), (other, rows(1, 5)), (other, rows(1, 6)), (b, rows(1, 7))]
        notice, replies = await send(items, data)
        errors = [r.error for r in replies.items]
        assert errors[0] == "" and "not one of this requester's" in errors[1]
        assert "no open route session" in errors[2] and "expected step 0 layer 1" in errors[3]
        assert notice.nbytes == HEADS * (HEAD_DIM + 2) * 4
        nan = rows(1, 8)
        nan[0, 0, 0] = np.nan
        notice, replies = await send([query("a", 2, 1), query("b", 1, 1)], [(a, nan), (b, rows(1, 9))])
        assert "NaN" in replies.items[0].error and replies.items[1].error == ""
    finally:
        for name in ("a", "b", "other"):
            await bus.request(bus.subjects.route("engine-0"), RouteClose(request_id=name), Ack, timeout_s=5)
        await tx.close()
        await rx.close()

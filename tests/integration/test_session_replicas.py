"""AMPD sessions across router processes: a router that holds no binding for a session (it restarted, or
another replica behind the same load balancer bound the session) sends its turn back to the decode engine
the index lists the session's KV on, instead of binding it afresh to the emptiest decode engine, which would
load (or recompute) the history the first one holds resident."""

from __future__ import annotations

import random

import aiohttp
import pytest

from shared.bus import Bus
from tests.cluster import Stack, wait_ready
from tests.integration.test_ampd import complete, metric

pytestmark = pytest.mark.slow

FINISHED = "kvpath_engine_requests_finished_total"


async def test_a_replica_without_the_binding_sends_the_turn_where_the_kv_is_resident(
    stack: tuple[Stack, Bus], http: aiohttp.ClientSession
) -> None:
    s, bus = stack
    engine = ("--model", "tiny", "--num-kv-blocks", "48")
    s.start("index", "index-0")
    for node in (0, 1):
        s.start("storage", f"storage-{node}", "--node", str(node), "--root", str(s.tmp / "store"))
    s.start("engine", "pe-0", "--role", "prefill", "--node", "0", *engine)
    for de in ("de-a", "de-b"):
        s.start("engine", de, "--role", "decode", "--session-kv", "--node", "1", *engine)
    for router in ("router-0", "router-1"):  # two replicas: each its own session table
        s.start("router", router, "--http-port", "0", "--policy", "ampd")
    ids = {"index-0", "storage-0", "storage-1", "pe-0", "de-a", "de-b", "router-0", "router-1"}
    ready = await wait_ready(bus, ids, s.procs, num_engines=3)
    urls = {sid: ready[sid].http_url for sid in ids}
    rng = random.Random(5)
    prompt = [rng.randrange(3, 250) for _ in range(700)]
    first = await complete(http, urls["router-0"], prompt, 8, "s1", "tiny", {})
    served = {de: await metric(http, urls[de], FINISHED) for de in ("de-a", "de-b")}
    holder = max(served, key=lambda de: served[de])
    other = "de-b" if holder == "de-a" else "de-a"  # emptier now: a fresh binding would take it
    turn2 = prompt + first["choices"][0]["token_ids"] + [rng.randrange(3, 250) for _ in range(40)]
    second = await complete(http, urls["router-1"], turn2, 8, "s1", "tiny", {})
    assert await metric(http, urls[holder], FINISHED) == 2 and await metric(http, urls[other], FINISHED) == 0
    binds = "kvpath_router_session_binds_total"
    assert await metric(http, urls["router-1"], binds, 'reason="resident"') == 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 700

"""The per-request SLO extension (`ttft_slo_ms`, `itl_slo_ms`): bad values fail alone with a 400 naming the
field; good ones reach the request; the session table's binding and LRU cap."""

from __future__ import annotations

from typing import Any

import pytest

from services.router.requests import parse_chat, parse_completion
from services.router.sessions import Flight, FlightBook, SessionTable
from shared.errors import InvalidRequestError
from shared.protocol import TokenBatch, TokenDelta


@pytest.mark.parametrize("name", ["ttft_slo_ms", "itl_slo_ms"])
@pytest.mark.parametrize("value", [0, -5, "100", True, float("inf"), 4e6, [1]])
def test_bad_slo_fields_are_refused_with_a_400_naming_them(name: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({"model": "tiny", "prompt": "hi", name: value})
    assert err.value.param == name and err.value.http_status == 400


def test_slo_fields_reach_the_request() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ttft_slo_ms": 350}
    req = parse_chat({**body, "itl_slo_ms": 40.5})
    assert (req.ttft_slo_ms, req.itl_slo_ms) == (350.0, 40.5)
    assert parse_chat(body).itl_slo_ms is None  # the router's default applies


def test_the_session_table_binds_and_forgets_the_least_recent() -> None:
    table = SessionTable(max_sessions=2)
    table.bind("a", "de0")
    table.bind("b", "de1")
    assert table.bound("a") == "de0"  # a is now the most recent
    table.bind("c", "de0")
    assert table.bound("b") is None and table.bound("a") == "de0" and len(table) == 2
    table.unbind("a")
    assert table.bound("a") is None


def test_the_flight_book_measures_ttft_per_prefill_engine_and_itl_per_decode_engine() -> None:
    book = FlightBook(window_s=10.0)
    book.start("r1", Flight("pe0", "de0", (100, 20), started=1.0, is_local=False))
    book.start("r2", Flight("de0", "de0", (50, 10), started=1.0, is_local=True))
    assert book.queue("pe0") == ((100, 20),) and book.queue("de0") == ((50, 10),)

    def batch(engine: str, *deltas: TokenDelta) -> TokenBatch:
        return TokenBatch(engine_id=engine, step=0, deltas=list(deltas))

    book.observe(batch("pe0", TokenDelta(request_id="r1", seq=0, token_ids=[5])), now=1.25)
    assert book.queue("pe0") == () and book.ttft.mean("pe0", 1.25) == pytest.approx(0.25)
    book.observe(batch("de0", TokenDelta(request_id="r2", seq=0, token_ids=[7])), now=1.5)
    assert book.ttft.mean("de0", 1.5) == 0.0  # a local prefill is no prefill engine's TTFT
    book.observe(batch("de0", TokenDelta(request_id="r1", seq=1, token_ids=[1, 2])), now=1.35)
    book.observe(batch("de0", TokenDelta(request_id="r2", seq=1, token_ids=[3], finish_reason="length")), 1.6)
    assert book.itl.mean("de0", 1.6) == pytest.approx((0.05 * 2 + 0.1) / 3)  # per token
    assert len(book) == 1  # r2 finished
    book.end("r1")
    assert len(book) == 0


def test_the_router_refuses_bad_ampd_settings() -> None:
    from services.router.config import RouterConfig
    from shared.errors import ConfigError

    RouterConfig(policy="ampd", ampd_slack_order="least-queue").validate()
    for bad in ({"ampd_slack_order": "fastest"}, {"ttft_slo_ms": 0.0}, {"ampd_beta": -1.0}):
        with pytest.raises(ConfigError):
            RouterConfig(policy="ampd", **bad).validate()

"""The engine's token outbox keeps what it sent of a request for a while, for a router that lost a batch."""

from __future__ import annotations

import pytest

from services.engine import outbox as outbox_module
from services.engine.outbox import TokenOutbox
from shared.protocol import TokenBatch, TokenDelta


def delta(rid: str, seq: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta(request_id=rid, seq=seq, token_ids=[seq + 10], finish_reason=finish)


async def test_sent_deltas_are_resent_from_any_seq_and_forgotten_once_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    published: list[TokenBatch] = []

    async def publish(router_id: str, batch: TokenBatch) -> None:
        if batch.deltas[0].seq == 1:  # a publish that fails: the delta is kept all the same
            raise ConnectionError("bus down")
        published.append(batch)

    clock = [1000.0]
    monkeypatch.setattr(outbox_module.time, "monotonic", lambda: clock[0])
    out = TokenOutbox("e1", publish)
    for seq in range(3):
        await out.flush([("router-0", delta("r1", seq, "stop" if seq == 2 else None), None)])
    await out.flush([("router-0", delta("r2", 0), None)])
    assert len(published) == 3
    assert [x.seq for x in out.resend("r1", 1)] == [1, 2] and out.resend("r1", 3) == []
    assert out.resend("unknown", 0) == []
    clock[0] += outbox_module.RETAIN_S - 1
    await out.flush([("router-0", delta("r2", 1), None)])  # r2 goes on; r1 is quiet
    clock[0] += 2
    await out.flush([("router-0", delta("r2", 2), None)])
    assert out.resend("r1", 0) == []  # quiet past RETAIN_S: forgotten
    assert [x.seq for x in out.resend("r2", 0)] == [1, 2]  # its delta 0 too: sent RETAIN_S + 1 ago


async def test_an_outages_worth_of_deltas_is_kept_and_older_ones_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fast engine sends hundreds of deltas a second while the router is cut off: the one the router
    misses first must still be there when it asks, seconds later (a count of 512 lost it in CI)."""

    async def publish(router_id: str, batch: TokenBatch) -> None:
        pass

    clock = [1000.0]
    monkeypatch.setattr(outbox_module.time, "monotonic", lambda: clock[0])
    out = TokenOutbox("e1", publish)
    for seq in range(3000):  # 300 steps/s for 10 s
        await out.flush([("router-0", delta("r1", seq), None)])
        clock[0] += 1 / 300
    assert [x.seq for x in out.resend("r1", 20)] == list(range(20, 3000))
    clock[0] += outbox_module.RETAIN_S - 5
    await out.flush([("router-0", delta("r1", 3000), None)])
    kept = out.resend("r1", 0)  # those sent more than RETAIN_S ago are gone, the rest kept
    assert 1000 < kept[0].seq < 2000 and kept[-1].seq == 3000


async def test_a_long_request_keeps_only_its_last_deltas() -> None:
    async def publish(router_id: str, batch: TokenBatch) -> None:
        pass

    out = TokenOutbox("e1", publish)
    n = outbox_module.RETAIN_DELTAS + 10
    for seq in range(n):
        await out.flush([("router-0", delta("r1", seq), None)])
    kept = out.resend("r1", 0)
    assert len(kept) == outbox_module.RETAIN_DELTAS and kept[0].seq == 10 and kept[-1].seq == n - 1

"""NoticeBoard and PeerTable: early and late notices, refusals, and every way a waiter is failed."""

from __future__ import annotations

import pytest

from shared.errors import OverloadedError, TransportError
from shared.transport.notices import Notice, NoticeBoard, PeerTable


async def test_notice_before_and_after_wait() -> None:
    board = NoticeBoard(max_pending=4)
    board.post(Notice("r", 1, b"early"))
    assert board.take("r", 1) == Notice("r", 1, b"early")
    assert board.take("r", 1) is None  # consumed
    future = board.add_waiter("r", 2, None)
    board.post(Notice("r", 2, b"late", peer_id="p"))
    assert (await future).meta == b"late"
    assert board.num_pending == 0 and board.num_waiters == 0


async def test_refusals() -> None:
    board = NoticeBoard(max_pending=2)
    board.post(Notice("r", 1))
    with pytest.raises(TransportError, match="already pending"):
        board.post(Notice("r", 1))
    board.post(Notice("r", 2))
    with pytest.raises(OverloadedError):
        board.post(Notice("r", 3))
    board.add_waiter("r", 9, None)
    with pytest.raises(TransportError, match="already waits"):
        board.add_waiter("r", 9, None)


async def test_fail_peer_only_hits_its_waiters() -> None:
    board = NoticeBoard(max_pending=8)
    mine = board.add_waiter("r", 1, "pe1")
    other = board.add_waiter("r", 2, "pe2")
    anyone = board.add_waiter("r", 3, None)
    assert board.fail_peer("pe1", TransportError("pe1 gone")) == 1
    with pytest.raises(TransportError, match="pe1 gone"):
        await mine
    assert not other.done() and not anyone.done()


async def test_fail_key_now_or_later() -> None:
    board = NoticeBoard(max_pending=8)
    waiting = board.add_waiter("r", 1, None)
    board.fail_key("r", 1, TransportError("cut off"))
    with pytest.raises(TransportError, match="cut off"):
        await waiting
    board.fail_key("r", 2, TransportError("cut off early"))
    with pytest.raises(TransportError, match="cut off early"):
        board.take("r", 2)
    assert board.take("r", 2) is None  # a failure is reported once
    board.fail_key("r", 3, TransportError("x"))
    board.post(Notice("r", 3, b"retried"))  # a retry that succeeds replaces the failure
    assert board.take("r", 3) == Notice("r", 3, b"retried")


async def test_fail_region_and_discard() -> None:
    board = NoticeBoard(max_pending=8)
    board.post(Notice("a", 1))
    board.post(Notice("a", 2))
    board.post(Notice("b", 1))
    waiting = board.add_waiter("a", 7, "pe")
    assert board.discard("a", [2]) == 1
    board.fail_region("a", TransportError("region gone"))
    with pytest.raises(TransportError, match="region gone"):
        await waiting
    assert board.take("a", 1) is None and board.take("b", 1) == Notice("b", 1)


async def test_restore_and_remove_waiter() -> None:
    board = NoticeBoard(max_pending=8)
    future = board.add_waiter("r", 1, None)
    board.remove_waiter("r", 1, future)
    assert board.num_waiters == 0
    board.restore(Notice("r", 1, b"back"))
    assert board.take("r", 1) == Notice("r", 1, b"back")


def test_peer_table_counts_connections() -> None:
    peers = PeerTable()
    peers.connected("pe")
    peers.connected("pe")
    assert not peers.disconnected("pe", "one of two closed")
    assert peers.gone_reason("pe") is None and peers.live() == ["pe"]
    assert peers.disconnected("pe", "killed")
    assert peers.gone_reason("pe") == "killed" and peers.live() == []
    peers.connected("pe")  # reconnect clears it
    assert peers.gone_reason("pe") is None
    assert peers.gone_reason("never-seen") is None

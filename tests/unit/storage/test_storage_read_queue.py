"""A node's read queue counts what the bandwidth budget has not let through: a reserved read drains at the
budget's rate (DualPath's read-side choice compares these queues; services/storage/reader.py)."""

from __future__ import annotations

from services.storage.reader import _PendingRead


def test_a_reserved_read_drains_at_the_budget_rate_and_a_waiting_one_counts_whole() -> None:
    read = _PendingRead("r", tokens_per_block=64, bytes_per_block=1000, blocks_left=10)
    assert read.blocks_queued(now=0.0) == 10  # not reserved yet
    read.delivered_by, read.rate_bytes_per_s = 10.0, 1000.0  # 10 blocks at 1 block/s from t = 0
    assert [read.blocks_queued(now=t) for t in (0.0, 4.5, 9.0, 10.0, 12.0)] == [10, 6, 1, 0, 0]
    behind = _PendingRead("s", tokens_per_block=64, bytes_per_block=1000, blocks_left=10)
    behind.delivered_by, behind.rate_bytes_per_s = 20.0, 1000.0  # queued behind the first
    assert behind.blocks_queued(now=0.0) == 10 and behind.blocks_queued(now=15.0) == 5
    unlimited = _PendingRead("u", tokens_per_block=64, bytes_per_block=1000, blocks_left=3)
    unlimited.delivered_by = 5.0
    assert unlimited.blocks_queued(now=100.0) == 3  # no budget: queued until the copy is done

"""The router's engine table: the KV format is adopted from the engines, and an engine that disagrees is
refused (it never reaches a snapshot, so no request goes to it)."""

from __future__ import annotations

import asyncio
import time

from services.router.engines import EngineTable
from shared.protocol import KvFormat, LoadReport

F32 = KvFormat(fingerprint="tiny;dtype=float32;block_size=64", block_size=64, bytes_per_token=4096)
BF16 = KvFormat(fingerprint="tiny;dtype=bfloat16;block_size=64", block_size=64, bytes_per_token=2048)


def report(
    service_id: str, kv_format: KvFormat | None, *, role: str = "colocated", seq: int = 1
) -> LoadReport:
    return LoadReport(
        service_id=service_id, role=role, node=0, seq=seq, sent_at=0.0, free_kv_blocks=10, kv_format=kv_format
    )


def ids(table: EngineTable) -> set[str]:
    return {e.engine_id for e in table.engine_snapshots(64)}


def test_the_first_format_is_adopted_and_a_different_one_refused() -> None:
    table = EngineTable(silence_timeout_s=3.0)
    assert table.kv_format is None
    now = time.monotonic()
    table.update(report("a", BF16), now=now)
    table.update(report("b", F32), now=now)
    table.update(report("c", BF16), now=now)
    assert table.kv_format == BF16
    assert ids(table) == {"a", "c"}
    assert "dtype=float32" in table.refused["b"] and "dtype=bfloat16" in table.refused["b"]
    table.update(report("d", None), now=now)
    assert "no KV format" in table.refused["d"] and "d" not in ids(table)


def test_storage_services_need_no_format() -> None:
    table = EngineTable(silence_timeout_s=3.0)
    table.update(report("s", None, role="storage"), now=0.0)
    assert table.storage_of(0) == "s" and not table.refused


def test_a_new_format_is_adopted_once_no_live_engine_holds_the_old_one() -> None:
    table = EngineTable(silence_timeout_s=3.0)
    now = time.monotonic()
    table.update(report("a", F32), now=now - 10)
    table.update(report("b", BF16), now=now - 9)
    assert table.kv_format == F32 and "b" in table.refused
    table.update(report("b", BF16, seq=2), now=now)  # "a" has been silent for 10 s: it is gone
    assert table.kv_format == BF16 and "b" not in table.refused
    table.update(report("a", F32, seq=5), now=now)  # "a" comes back with the old format: refused now
    assert "a" in table.refused and ids(table) == {"b"}


def test_a_suspect_engine_is_out_of_every_decision_until_it_reports_again() -> None:
    """Another engine saw it go (its KV connection closed): no snapshot or placement table offers it, its
    streams are not failed for it (it is not silent); a report it may have sent before it went (the next
    number) keeps it out, a later one (or a restart's, seq 1) brings it back."""
    table = EngineTable(silence_timeout_s=3.0)
    now = time.monotonic()
    for engine_id in ("a", "b"):
        table.update(report(engine_id, F32), now=now)
    assert {e.engine_id for e in table.load_table(64, now).engines()} == {"a", "b"}
    assert table.suspect("a") and not table.suspect("a") and not table.suspect("nobody")
    assert ids(table) == {"b"} and table.silent(now) == []
    table.note_assigned("a", 100)  # a late note for it does not put it back in the placement table
    assert {e.engine_id for e in table.load_table(64, now).engines()} == {"b"}
    table.update(report("a", F32, seq=2), now=now + 0.1)  # sent before it went, maybe
    assert ids(table) == {"b"}
    table.update(report("a", F32, seq=3), now=now + 0.1)
    assert ids(table) == {"a", "b"}
    assert {e.engine_id for e in table.load_table(64, now + 0.1).engines()} == {"a", "b"}
    assert table.suspect("a")
    table.update(report("a", F32, seq=1), now=now + 0.2)  # restarted: a new process, not the lost one
    assert ids(table) == {"a", "b"}


async def test_next_report_waits_for_that_engines_next_report_only() -> None:
    """`next_report` (a lost task ack is sent again once its engine reports): True on that engine's next
    report, not another's and not a stale one; False when none comes in time; no waiter is left behind."""
    table = EngineTable(silence_timeout_s=3.0)
    table.update(report("a", BF16, seq=5), now=time.monotonic())
    waiting = asyncio.ensure_future(table.next_report("a", 5.0))
    await asyncio.sleep(0)  # one loop turn: the task runs up to its wait, which registers the waiter
    (waiter,) = table._report_waiters["a"]
    table.update(report("b", BF16), now=time.monotonic())
    table.update(report("a", BF16, seq=4), now=time.monotonic())  # stale: dropped
    assert not waiter.done() and table._report_waiters["a"] == [waiter]
    table.update(report("a", BF16, seq=6), now=time.monotonic())
    assert await asyncio.wait_for(waiting, 1.0) is True
    assert await table.next_report("a", 0.01) is False
    assert not table._report_waiters


def test_an_engines_silence_while_the_bus_is_down_is_not_its_death() -> None:
    """A bus that carries nothing silences every engine at once (a frozen nats-server): while it is down no
    engine is silent; once it is back each gets a full silence timeout again, and one that stays silent is
    silent then (it died meanwhile)."""
    table = EngineTable(silence_timeout_s=3.0)
    table.update(report("a", BF16, seq=1), now=100.0)
    table.update(report("b", BF16, seq=1), now=100.0)
    table.bus_down(101.0)
    table.bus_down(102.0)  # still the same outage
    assert table.bus_down_since == 101.0
    assert table.silent(now=108.0) == []
    table.bus_up(108.0)
    table.bus_up(108.5)  # up already: nothing moves
    assert table.silent(now=110.0) == []
    assert {e.engine_id for e in table.engine_snapshots(64, now=110.0)} == {"a", "b"}  # live for placement
    table.update(report("a", BF16, seq=2), now=110.5)
    assert table.silent(now=111.2) == ["b"]

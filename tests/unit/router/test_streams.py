"""Router-side token streams: order, gaps, duplicates, engine failure fan-out."""

from __future__ import annotations

from services.router.streams import StreamTable
from shared.errors import EngineFailedError
from shared.protocol import TokenBatch, TokenDelta


def batch(*deltas: TokenDelta, engine: str = "e1") -> TokenBatch:
    return TokenBatch(engine_id=engine, step=0, deltas=list(deltas))


def d(rid: str, seq: int, *tokens: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta(request_id=rid, seq=seq, token_ids=list(tokens), finish_reason=finish)


def test_in_order_delivery_and_duplicates_dropped() -> None:
    table = StreamTable()
    s = table.open("r1", "e1")
    assert table.deliver(batch(d("r1", 0, 5), d("r1", 1, 6))) == 2
    assert table.deliver(batch(d("r1", 1, 6))) == 0  # duplicate
    items = [s.queue.get_nowait() for _ in range(s.queue.qsize())]
    assert [i.token_ids for i in items if isinstance(i, TokenDelta)] == [[5], [6]]


def test_out_of_order_deltas_are_reordered() -> None:
    # after a PE -> DE hand-off the DE's first delta may overtake the PE's
    table = StreamTable()
    s = table.open("r1", "pe")
    table.assign("r1", "de")
    assert table.deliver(batch(d("r1", 1, 7), engine="de"), now=1.0) == 0
    handoff = d("r1", 0, 6)
    handoff.handoff = True
    assert table.deliver(batch(handoff, engine="pe"), now=1.1) == 2
    got = [s.queue.get_nowait() for _ in range(2)]
    assert [x.token_ids for x in got if isinstance(x, TokenDelta)] == [[6], [7]]
    assert table.fail_engine("pe", EngineFailedError("gone")) == 0  # the PE handed off: not its stream now
    assert table.expire_gaps(now=10.0, window_s=2.0) == 0


def test_gap_that_never_closes_fails_the_stream() -> None:
    table = StreamTable()
    s = table.open("r1", "e1")
    table.deliver(batch(d("r1", 0, 1), d("r1", 2, 3)), now=5.0)
    assert isinstance(s.queue.get_nowait(), TokenDelta)
    assert table.expire_gaps(now=6.0, window_s=2.0) == 0  # still within the reorder window
    assert table.expire_gaps(now=7.5, window_s=2.0) == 1
    err = s.queue.get_nowait()
    assert isinstance(err, EngineFailedError) and "delta 1 never arrived" in err.message
    assert table.deliver(batch(d("r1", 1, 2)), now=8.0) == 0  # nothing after the failure


def test_tokens_before_assignment_are_kept() -> None:
    table = StreamTable()
    s = table.open("r1")
    table.deliver(batch(d("r1", 0, 9)))
    table.assign("r1", "e7")
    assert table.fail_engine("e7", EngineFailedError("gone")) == 1
    assert isinstance(s.queue.get_nowait(), TokenDelta)
    assert isinstance(s.queue.get_nowait(), EngineFailedError)


def test_fail_engine_touches_only_its_streams_and_close_unlinks() -> None:
    table = StreamTable()
    a, b = table.open("a", "e1"), table.open("b", "e2")
    assert table.fail_engine("e1", EngineFailedError("dead")) == 1
    assert a.queue.qsize() == 1 and b.queue.qsize() == 0
    table.close("a")
    table.close("b")
    assert table.engines_with_streams() == [] and len(table) == 0


def test_choice_0_handed_off_frees_every_choice_from_the_prefill_engine() -> None:
    # n choices as one DualPath task: the PE prefills choice 0 only, the DE streams every choice
    table = StreamTable()
    first = table.open("r", "pe")
    first.choice_ids = ["r-1", "r-2"]
    for rid in first.choice_ids:
        table.open(rid, "pe")
    for rid in ["r", *first.choice_ids]:
        table.assign(rid, "de")
    handoff = d("r", 0, 6)
    handoff.handoff = True
    table.deliver(batch(handoff, engine="pe"))
    assert table.fail_engine("pe", EngineFailedError("gone")) == 0  # no choice depends on the PE now
    assert table.fail_engine("de", EngineFailedError("gone")) == 3


def test_a_stream_lost_with_its_engine_restarts_under_a_new_id() -> None:
    """fail_engine names the lost engine; restart undoes the failure, forgets the lost attempt's engines and
    takes only the new attempt's deltas, counted from 0 again; a retry of the new attempt (`retarget` by its
    id) still reaches the stream."""
    table = StreamTable()
    s = table.open("r1", "pe")
    table.assign("r1", "de")
    assert table.fail_engine("pe", EngineFailedError("pe stopped responding")) == 1
    assert s.lost_engine == "pe" and s.is_finished
    table.restart("r1", "r1-lost1")
    assert not s.is_finished and s.lost_engine == "" and s.queue.empty() and s.engine_ids == set()
    assert table.engines_with_streams() == []  # the lost attempt's engines no longer fail it
    table.assign("r1-lost1", "de")
    assert table.deliver(batch(d("r1", 0, 5), engine="de")) == 0  # the lost attempt's late delta
    assert table.deliver(batch(d("r1-lost1", 0, 6), engine="de")) == 1
    table.retarget("r1-lost1", "r1-lost1-retry1")  # a dispatch's own retry of the new attempt
    assert table.deliver(batch(d("r1-lost1-retry1", 1, 7, finish="length"), engine="de")) == 1
    got = [s.queue.get_nowait() for _ in range(2)]
    assert [x.token_ids for x in got if isinstance(x, TokenDelta)] == [[6], [7]]
    assert table.close("r1") == ["r1", "r1-lost1", "r1-lost1-retry1"]


def test_a_stream_already_finished_is_not_marked_lost() -> None:
    table = StreamTable()
    s = table.open("r1", "e1")
    assert table.deliver(batch(d("r1", 0, 5, finish="stop"))) == 1
    table.fail_engine("e1", EngineFailedError("gone"))
    assert s.lost_engine == ""


def test_a_silent_engine_fails_each_stream_once() -> None:
    """The silence sweep runs again while a failed stream waits for its redispatch: it is not failed (nor
    counted) again."""
    table = StreamTable()
    table.open("r1", "pe")
    table.open("r2", "pe")
    assert table.fail_engine("pe", EngineFailedError("silent")) == 2
    assert table.fail_engine("pe", EngineFailedError("silent")) == 0
    table.restart("r1", "r1-lost1")
    table.assign("r1-lost1", "pe")  # the new attempt went to it again
    assert table.fail_engine("pe", EngineFailedError("silent")) == 1


def test_streams_with_a_gap_or_a_silence_are_probed_once_per_period() -> None:
    """What the router asks engines to resend (a token batch NATS lost): a gap past `gap_s`, a stream with no
    delta for `silent_s` (its last deltas, maybe its finish, lost); each at most once per period; never a
    finished stream or one no engine serves yet."""
    table = StreamTable()
    gap, quiet, done = table.open("gap", "e1"), table.open("quiet", "e2"), table.open("done", "e1")
    table.open("unassigned")
    table.deliver(batch(d("gap", 0, 1), d("gap", 2, 3), d("done", 0, 1, finish="stop")), now=100.0)
    gap.progress_at = quiet.progress_at = done.progress_at = 100.0
    assert table.to_probe(100.2, gap_s=0.5, silent_s=5.0) == []  # a reordering may still close the gap
    assert table.to_probe(100.6, gap_s=0.5, silent_s=5.0) == [("gap", 1, ["e1"])]
    assert table.to_probe(100.8, gap_s=0.5, silent_s=5.0) == []  # asked already
    assert table.to_probe(101.2, gap_s=0.5, silent_s=5.0) == []  # e1 has not answered yet
    table.answered("gap")
    assert table.to_probe(105.2, gap_s=0.5, silent_s=5.0) == [("gap", 1, ["e1"]), ("quiet", 0, ["e2"])]
    table.deliver(batch(d("gap", 1, 2)), now=105.3)  # the resent delta closes the gap
    got = [gap.queue.get_nowait() for _ in range(gap.queue.qsize())]
    assert [x.token_ids for x in got if isinstance(x, TokenDelta)] == [[1], [2], [3]]
    assert table.to_probe(106.0, gap_s=0.5, silent_s=5.0) == []


def test_a_gap_whose_engines_are_being_asked_waits_for_their_answer() -> None:
    """The gap window (2 s) may end while an ask for the missing delta is in flight to a busy engine: the gap
    then waits up to `ask_wait_s` more for the answer, and expires as before once the engines answered
    without it (CI saw a stream fail with its delta on the way)."""
    table = StreamTable()
    asked, idle = table.open("asked", "e1"), table.open("idle", "e1")
    table.deliver(batch(d("asked", 1, 2), d("idle", 1, 2)), now=100.0)
    asked.progress_at = idle.progress_at = 100.0
    assert [t for t, _, _ in table.to_probe(100.6, gap_s=0.5, silent_s=5.0)] == ["asked", "idle"]
    table.answered("idle")  # e1 answered without idle's delta 0
    assert table.expire_gaps(now=102.5, window_s=2.0, ask_wait_s=2.0) == 1
    assert idle.is_finished and not asked.is_finished
    assert table.expire_gaps(now=103.9, window_s=2.0, ask_wait_s=2.0) == 0
    table.answered("asked")
    table.answered("asked")  # one answer too many (never below zero)
    assert asked.asks == 0
    assert table.expire_gaps(now=104.0, window_s=2.0, ask_wait_s=2.0) == 1


def test_deltas_no_stream_takes_name_orphans_unless_closed_here_or_finished() -> None:
    """`unknown` (what `orphans.py` aborts): a delta of a request the router never opened (a restarted
    router's previous process's) that does not finish it; not a late delta of a stream it closed (that
    close aborted it already), not a finishing one (the engine is done with it)."""
    table = StreamTable()
    table.open("live", "e1")
    table.open("closed", "e1")
    table.close("closed")
    table.deliver(
        batch(d("live", 0, 1), d("closed", 3, 4), d("old", 7, 8), d("old-done", 9, 9, finish="stop"))
    )
    assert table.unknown == {"old"}

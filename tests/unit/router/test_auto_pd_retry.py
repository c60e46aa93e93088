"""`--policy auto` on prefill/decode engines, when a send fails: only the engine at fault is left out of the
next decision, the failed attempt is aborted under its own id, and the retry goes under a new one whose
deltas (only) reach the request's stream."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from services.policy.auto import LOCAL, REMOTE, Decision, Plan, Source
from services.router.auto_pd import dispatch_pd
from services.router.dispatch import Dispatch
from services.router.streams import StreamTable
from shared.errors import NoEngineAvailableError, ServiceUnavailableError
from shared.protocol import Abort, GenerateTask, Message, TaskAck, TokenBatch, TokenDelta
from shared.protocol.subjects import Subjects
from shared.protocol.tasks import BufferRef, DecodeTask, PrefillTask
from tests.unit.router.test_auto_dispatch import PD, dispatch, plan


class FakeBus:
    """Engines that answer tasks by subject: `dead` ones have no responders; the others accept."""

    def __init__(self, dead: set[str]) -> None:
        self.subjects = Subjects("t")
        self.dead = dead
        self.tasks: list[tuple[str, str, str]] = []  # (engine, task kind, request id)
        self.aborts: list[str] = []

    async def request(self, subject: str, msg: Message, reply_type: Any, *, timeout_s: float) -> TaskAck:
        engine = subject.rsplit(".", 1)[-1]
        assert isinstance(msg, DecodeTask | PrefillTask | GenerateTask)
        self.tasks.append((engine, msg.KIND, msg.request_id))
        if engine in self.dead:
            raise ServiceUnavailableError(f"no service answers on {subject}")
        buffer = BufferRef(engine_id=engine, endpoint={}, region="r", offset=0, slot=0, num_blocks=1)
        return TaskAck(request_id=msg.request_id, accepted=True, buffer=buffer)

    async def publish(self, subject: str, msg: Message) -> None:
        assert subject == self.subjects.abort and isinstance(msg, Abort)
        self.aborts.append(msg.request_id)


def remote_while_a_pe_lives(engines: Any, _plan: Any, _locality: Any) -> Decision | None:
    """Remote on pe -> de while both are offered, else local on de, else nothing."""
    ids = {e.engine_id for e in engines}
    if "de" not in ids:
        return None
    where, pe = (REMOTE, "pe") if "pe" in ids else (LOCAL, "de")
    return Decision(Plan(where, Source.RECOMPUTE, pe, "de", 0, "", 0.1, 0.0), None, 1, True)


def pd_dispatch(dead: set[str]) -> tuple[Dispatch, FakeBus, StreamTable]:
    auto = dispatch(PD)
    bus = FakeBus(dead)
    auto.bus = bus  # type: ignore[assignment]
    streams = StreamTable()
    streams.open("r")
    return auto, bus, streams


async def test_a_dead_prefill_engine_leaves_the_decode_engine_to_prefill_under_a_new_id() -> None:
    auto, bus, streams = pd_dispatch(dead={"pe"})
    sent = await dispatch_pd(auto, remote_while_a_pe_lives, plan("r"), 1e18, streams, {})
    assert sent.decision.chosen.where == LOCAL and sent.task_id == "r-retry1"
    assert bus.tasks == [
        ("de", "decode_task", "r"),
        ("pe", "prefill_task", "r"),
        ("de", "generate_task", "r-retry1"),
    ]
    assert set(bus.aborts) == {"r"}  # the first attempt's turn on the DE, never the retry
    stream = streams.get("r")
    assert stream is not None and stream.engine_ids == {"de"}
    late = TokenDelta(request_id="r", seq=0, token_ids=[1])  # the given-up attempt: dropped
    retried = TokenDelta(request_id="r-retry1", seq=0, token_ids=[2])
    assert streams.deliver(TokenBatch(engine_id="de", step=1, deltas=[late, retried])) == 1
    assert stream.queue.get_nowait() is retried
    assert streams.close("r") == ["r", "r-retry1"]  # the router's final abort names both


async def test_a_dead_decode_engine_fails_the_request_without_a_retry_on_its_prefill_engine() -> None:
    auto, bus, streams = pd_dispatch(dead={"de"})
    with pytest.raises(NoEngineAvailableError, match="no service answers"):
        await dispatch_pd(auto, remote_while_a_pe_lives, plan("r"), 1e18, streams, {})
    assert bus.tasks == [("de", "decode_task", "r")] and bus.aborts == ["r"]
    assert streams.close("r") == ["r"]


async def test_a_suspect_prefill_engine_is_left_out_until_it_reports_again() -> None:
    """The decode engine saw the PE's KV connection close (`EngineTable.suspect`): the next decision goes
    local without sending the PE anything, although its silence is not heard yet; a report numbered past
    the one that may have been on its way brings it back."""
    auto, bus, streams = pd_dispatch(dead=set())
    assert auto.engines.suspect("pe")
    sent = await dispatch_pd(auto, remote_while_a_pe_lives, plan("r"), 1e18, streams, {})
    assert sent.decision.chosen.where == LOCAL and bus.tasks == [("de", "generate_task", "r")]
    state = auto.engines.get("pe")
    assert state is not None
    auto.engines.update(replace(state.report, seq=state.report.seq + 2), now=time.monotonic())
    streams.open("r2")
    sent = await dispatch_pd(auto, remote_while_a_pe_lives, plan("r2"), 1e18, streams, {})
    assert sent.decision.chosen.where == REMOTE and ("pe", "prefill_task", "r2") in bus.tasks

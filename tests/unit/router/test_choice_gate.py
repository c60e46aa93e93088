"""`ChoiceGate`: when the choices 1..n-1 of a request sent as n one-choice tasks may be planned. The index
lookups it makes once choice 0 streams are covered on real engines (`tests/integration/test_auto_policy.py`,
n choices on session engines)."""

from __future__ import annotations

import asyncio

import pytest

from services.router.choices import ChoiceGate
from services.router.kv_plan import KvPlanner
from services.router.streams import StreamTable
from shared.protocol import KvPlan

NO_INDEX = KvPlanner.__new__(KvPlanner)  # never asked: the cases below decide without a lookup
NO_INDEX.index = object()  # type: ignore[assignment]  # an index exists (a router that reuses KV)


def plan(num_blocks: int, num_hit_blocks: int) -> KvPlan:
    return KvPlan(block_hashes=list(range(1, num_blocks + 1)), num_hit_blocks=num_hit_blocks)


async def test_a_prompt_stored_but_for_its_last_block_lets_the_others_go_at_once() -> None:
    gate = ChoiceGate("r")
    gate.dispatched_prompt(plan(10, 9), {}, NO_INDEX)
    assert await gate.join(StreamTable(), "r-1", 0.0) is None


async def test_a_prompt_resident_on_an_engine_counts_as_found() -> None:
    gate = ChoiceGate("r")
    gate.dispatched_prompt(plan(10, 0), {"hbm:de-0": 10, "store": 2}, NO_INDEX)
    assert gate.ready.is_set()


async def test_others_wait_for_a_computed_prompt_until_choice_0_ends_or_their_deadline() -> None:
    gate = ChoiceGate("r")
    gate.dispatched_prompt(plan(10, 2), {"store": 2}, NO_INDEX)
    with pytest.raises(TimeoutError):
        await gate.join(StreamTable(), "r-1", 0.05)  # the deadline: the caller's deadline error
    waiting = asyncio.create_task(gate.join(StreamTable(), "r-2", 5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    gate.ended("r-1")  # another choice gave up: the rest still wait
    await asyncio.sleep(0)
    assert not waiting.done()
    gate.ended("r")  # choice 0 failed or finished: the others go, whatever is stored
    assert await asyncio.wait_for(waiting, 1.0) is None


async def test_without_an_index_the_others_go_at_once() -> None:
    """A router that reuses no KV (`--no-use-kv-cache`) never sees the prompt listed: no wait."""
    planner = KvPlanner.__new__(KvPlanner)
    planner.index = None
    gate = ChoiceGate("r")
    gate.dispatched_prompt(plan(10, 0), {}, planner)
    assert gate.ready.is_set()

"""`PersistChain.num_written_blocks`: what a preempted sequence reads back is what the store has. A write
still on its way, or failed, ends the count (before, every staged block counted, and reading those back
found them missing: 35 `missing` KV reads in a run of 100 concurrent SmolLM2 chats on a 24-block cache)."""

from __future__ import annotations

import asyncio

from services.engine.persist import WRITE_FAILED, PersistChain


async def written(result: int) -> int:
    return result


async def test_written_blocks_stop_at_the_first_write_not_done_or_failed() -> None:
    assert PersistChain(3).num_written_blocks() == 3  # nothing written since: what it started with
    gate = asyncio.Event()

    async def pending() -> int:
        await gate.wait()
        return 9

    chain = PersistChain(7)
    chain.writes = [asyncio.create_task(written(5)), asyncio.create_task(pending())]
    chain.spans = [(2, 5), (5, 7)]
    await asyncio.sleep(0)
    assert chain.num_written_blocks() == 5  # the second write is on its way
    gate.set()
    await asyncio.gather(*chain.writes)
    assert chain.num_written_blocks() == 7
    chain.writes.append(asyncio.create_task(written(WRITE_FAILED)))
    chain.writes.append(asyncio.create_task(written(12)))
    chain.spans += [(7, 8), (8, 9)]
    await asyncio.gather(*chain.writes)
    assert chain.num_written_blocks() == 7  # block 7 failed: the store's chain ends before it


async def test_a_forked_choice_counts_its_prompt_blocks_once_choice_0_wrote_them() -> None:
    gate = asyncio.Event()

    async def pending() -> int:
        await gate.wait()
        return 4

    parent = PersistChain(3)  # as `persist` leaves it: blocks 0-2 staged, their write on its way
    parent.writes, parent.spans = [asyncio.create_task(pending())], [(0, 3)]
    child = parent.fork()  # n choices: the child's prompt blocks are choice 0's, on their way
    await asyncio.sleep(0)
    # before: the child's chain started at 3 blocks with no writes, and read back blocks not yet stored
    assert child.num_persisted_blocks == 3 and child.num_written_blocks() == 0
    gate.set()
    await asyncio.gather(*parent.writes)
    assert child.num_written_blocks() == 3

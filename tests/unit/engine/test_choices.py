"""n choices of one request on the real engine core and the tiny model: one prefill, forked block tables.

The prompt is prefilled once (the engine's prefill-token counter moves by its length, not n times it); each
choice's tokens equal those of a request of its own with the seed the rule gives it (`seed + i`), which
fails if a choice ever wrote into a block it shares (the copy-on-write of the partly filled last block);
greedy choices are equal; every block is free again once the request ends, is aborted (before or after the
fork) or when one choice fails alone in the model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpu.runner import ModelRunner
from services.engine import metrics
from services.engine.config import EngineConfig
from services.engine.core import EngineCore
from shared.hashing import block_hashes
from shared.protocol import GenerateTask, RequestPlan, SamplingParams, TokenBatch
from shared.protocol.tasks import KvPlan, choice_request_id

BLOCK = 16
PROMPT = [(5 * j) % 200 + 3 for j in range(2 * BLOCK + 9)]  # two full blocks and a partly filled one
HASHES: list[int] = []  # the prompt's block hashes for the runner's KV format (set by the fixture)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRunner]:
    runner = ModelRunner.load(
        "tiny", cache_dir=str(tmp_path_factory.mktemp("models")), num_kv_blocks=64, block_size=BLOCK
    )
    HASHES[:] = block_hashes(PROMPT, BLOCK, runner.fingerprint)
    yield runner
    runner.close()


def task(
    request_id: str, n: int, *, temperature: float = 1.0, seed: int | None = 7, max_tokens: int = 12
) -> Any:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, n=n)
    plan = RequestPlan(
        request_id=request_id,
        router_id="router-0",
        prompt_token_ids=PROMPT,
        sampling=sampling,
        deadline_unix_s=time.time() + 60,
        kv=KvPlan(block_hashes=HASHES),
    )
    return GenerateTask(plan=plan)


class Engine:
    """The engine core running its loop; every delta it publishes, by request id."""

    def __init__(self, runner: ModelRunner) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.ended: dict[str, tuple[str, str]] = {}
        self.changed = asyncio.Event()
        self.core = EngineCore(EngineConfig(model="tiny", max_num_seqs=8), runner, "engine-t", self.publish)
        self.loop: asyncio.Task[None] | None = None

    async def publish(self, router_id: str, batch: TokenBatch) -> None:
        for delta in batch.deltas:
            self.tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finish_reason:
                self.ended[delta.request_id] = (delta.finish_reason, delta.error_code)
        self.changed.set()

    async def wait(self, condition: Any) -> None:
        while not condition():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 30)

    async def __aenter__(self) -> Engine:
        self.loop = asyncio.create_task(self.core.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.loop is not None
        self.loop.cancel()
        await self.core.close()


async def run(runner: ModelRunner, *tasks: Any) -> dict[str, list[int]]:
    async with Engine(runner) as engine:
        ids = [choice_request_id(t.request_id, i) for t in tasks for i in range(t.plan.sampling.n)]
        for t in tasks:
            assert engine.core.submit(t).accepted
        await engine.wait(lambda: all(i in engine.ended for i in ids))
        assert all(engine.ended[i] == ("length", "") for i in ids), engine.ended
        await engine.wait(lambda: not engine.core.seqs)
        return engine.tokens


async def test_n_choices_prefill_once_sample_independently_and_free_their_blocks(runner: ModelRunner) -> None:
    free = runner.kv.num_free_blocks
    prefilled = metrics.PREFILL_TOKENS._value.get()
    tokens = await run(runner, task("r", 4))
    assert metrics.PREFILL_TOKENS._value.get() - prefilled == len(PROMPT)  # once, not 4 times
    assert runner.kv.num_free_blocks == free
    choices = [tokens[choice_request_id("r", i)] for i in range(4)]
    assert len({tuple(c) for c in choices}) == 4  # independent samples
    alone = await run(runner, *(task(f"alone{i}", 1, seed=7 + i) for i in range(4)))
    assert choices == [alone[f"alone{i}"] for i in range(4)]  # choice i is the request seeded 7 + i
    greedy = await run(runner, task("g", 3, temperature=0.0), task("g1", 1, temperature=0.0))
    assert greedy["g"] == greedy["g-1"] == greedy["g-2"] == greedy["g1"]
    assert runner.kv.num_free_blocks == free


async def test_aborting_every_choice_frees_every_block_before_and_after_the_fork(runner: ModelRunner) -> None:
    free = runner.kv.num_free_blocks
    async with Engine(runner) as engine:
        assert engine.core.submit(task("early", 3, max_tokens=400)).accepted
        engine.core.abort("early")  # choice 0 leaves before its prefill: the others leave with it
        assert engine.core.submit(task("late", 3, max_tokens=400)).accepted
        await engine.wait(lambda: all(len(engine.tokens.get(f"late-{i}", [])) >= 3 for i in (1, 2)))
        assert runner.kv.num_free_blocks < free - 3  # 3 prompt blocks shared, plus each choice's own
        for i in range(3):  # what the router does when the client goes away: abort every choice
            engine.core.abort(choice_request_id("late", i))
        await engine.wait(lambda: not engine.core.seqs)
        assert not engine.ended and "early" not in engine.tokens  # aborted silently, as asked
    assert runner.kv.num_free_blocks == free


async def test_a_choice_failing_in_the_model_fails_alone(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = runner.kv.num_free_blocks
    real = runner.decode

    async def fault(seqs: list[Any]) -> Any:  # FAULT INJECTION: a kernel fault on choice 2's rows
        if any(s.seq_id == "f-2" for s in seqs):
            raise RuntimeError("injected kernel fault")
        return await real(seqs)

    monkeypatch.setattr(runner, "decode", fault)
    async with Engine(runner) as engine:
        assert engine.core.submit(task("f", 4)).accepted
        await engine.wait(lambda: len(engine.ended) == 4)
        await engine.wait(lambda: not engine.core.seqs)
    assert engine.ended["f-2"] == ("error", "engine_failed")
    assert [engine.ended[i] for i in ("f", "f-1", "f-3")] == [("length", "")] * 3
    assert runner.kv.num_free_blocks == free

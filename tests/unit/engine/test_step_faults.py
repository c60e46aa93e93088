"""A request that fails inside a batched model step fails alone: the rest of its batch goes on.

No input that passes admission fails the model today (the bus schema and the engine's checks refuse bad
parameters before a request joins a batch), so the fault is injected: a FAULT INJECTION wrapper around the
real runner raises whenever the batch holds the poisoned request. Everything else is real: the tiny model,
the engine core, its scheduler and its sampler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpu.runner import ModelRunner
from services.engine.config import EngineConfig
from services.engine.core import EngineCore
from shared.protocol import GenerateTask, RequestPlan, SamplingParams, TokenBatch
from shared.protocol.tasks import KvPlan

POISON = "poison"


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRunner]:
    runner = ModelRunner.load("tiny", cache_dir=str(tmp_path_factory.mktemp("models")), num_kv_blocks=96)
    yield runner
    runner.close()


class FaultInjection:
    """FAULT INJECTION (a mock of a model fault): the runner's step raises when `POISON` is in its batch,
    in the phase named; otherwise the real runner computes."""

    def __init__(self, runner: ModelRunner, phase: str) -> None:
        self.real = getattr(runner, phase)
        self.batches: list[list[str]] = []

    async def __call__(self, seqs: list[Any], *args: Any) -> Any:
        ids = [s.seq_id for s in seqs]
        self.batches.append(ids)
        if POISON in ids:
            raise RuntimeError("injected kernel fault")
        return await self.real(seqs, *args)


def task(request_id: str, prompt: list[int], max_tokens: int) -> GenerateTask:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plan = RequestPlan(
        request_id=request_id,
        router_id="router-0",
        prompt_token_ids=prompt,
        sampling=sampling,
        deadline_unix_s=time.time() + 60,
        kv=KvPlan(block_hashes=[]),
    )
    return GenerateTask(plan=plan)


async def run_requests(
    runner: ModelRunner, requests: dict[str, list[int]], max_tokens: int
) -> dict[str, Any]:
    """Submit all at once, run the engine loop until every request ended; per request: (tokens, finish,
    error code)."""
    ended: dict[str, Any] = {}
    all_ended = asyncio.Event()
    tokens: dict[str, list[int]] = {r: [] for r in requests}

    async def publish(router_id: str, batch: TokenBatch) -> None:
        for delta in batch.deltas:
            tokens[delta.request_id] += delta.token_ids
            if delta.finish_reason:
                ended[delta.request_id] = (tokens[delta.request_id], delta.finish_reason, delta.error_code)
        if len(ended) == len(requests):
            all_ended.set()

    core = EngineCore(EngineConfig(model="tiny", max_num_seqs=8), runner, "engine-t", publish)
    for rid, prompt in requests.items():
        assert core.submit(task(rid, prompt, max_tokens)).accepted
    loop = asyncio.create_task(core.run())
    try:
        await asyncio.wait_for(all_ended.wait(), 60)
    finally:
        loop.cancel()
        await core.close()
    return ended


@pytest.mark.parametrize("phase", ["decode", "prefill"])
async def test_a_request_failing_in_the_model_fails_alone(
    runner: ModelRunner, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = {f"r{i}": [(7 * i + j) % 200 + 1 for j in range(12 + i)] for i in range(5)}
    baseline = await run_requests(runner, prompts, max_tokens=6)
    fault = FaultInjection(runner, phase)
    monkeypatch.setattr(runner, phase, fault)
    ended = await run_requests(runner, {**prompts, POISON: [5, 6, 7, 8]}, max_tokens=6)
    assert any(POISON in b and len(b) > 1 for b in fault.batches), "the poison shared a batch"
    assert ended[POISON][1] == "error" and ended[POISON][2] == "engine_failed"
    for rid in prompts:  # everyone else: the same tokens as without the poison
        assert ended[rid] == baseline[rid]
        assert ended[rid][1] == "length" and len(ended[rid][0]) == 6

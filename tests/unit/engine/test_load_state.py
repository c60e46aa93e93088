"""The release schedule of an engine's load report, on the real engine core and the tiny model: when the
running requests give their KV back (soonest first, at the answers' upper bounds in timed steps), which the
router prices a wait for memory with (`memory_wait_s`); and the schedule's rules on hand-made sequences."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from gpu.runner import ModelRunner
from services.engine.config import EngineConfig
from services.engine.core import EngineCore
from services.engine.load_state import MAX_RELEASES, release_schedule
from services.engine.sequence import SeqStatus
from services.engine.warmup import seed_prefill_rates
from services.policy.quota import step_budget
from shared.hashing import block_hashes
from shared.protocol import (
    COMPUTE_RATE,
    PROMPT_RATE,
    GenerateTask,
    LoadReport,
    RequestPlan,
    SamplingParams,
    TokenBatch,
)
from shared.protocol.codec import decode, encode
from shared.protocol.tasks import KvPlan

BLOCK = 16
PROMPT = [(7 * j) % 150 + 3 for j in range(3 * BLOCK + 5)]


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRunner]:
    runner = ModelRunner.load(
        "tiny", cache_dir=str(tmp_path_factory.mktemp("models")), num_kv_blocks=64, block_size=BLOCK
    )
    yield runner
    runner.close()


def task(runner: ModelRunner, request_id: str, max_tokens: int) -> GenerateTask:
    plan = RequestPlan(
        request_id=request_id,
        router_id="router-0",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        deadline_unix_s=time.time() + 60,
        kv=KvPlan(block_hashes=block_hashes(PROMPT, BLOCK, runner.fingerprint)),
    )
    return GenerateTask(plan=plan)


async def test_a_decoding_engine_reports_when_its_requests_give_kv_back(runner: ModelRunner) -> None:
    tokens: dict[str, int] = {}
    changed = asyncio.Event()

    async def publish(router_id: str, batch: TokenBatch) -> None:
        for delta in batch.deltas:
            tokens[delta.request_id] = tokens.get(delta.request_id, 0) + len(delta.token_ids)
        changed.set()

    async def until(condition: Any) -> None:
        while not condition():
            changed.clear()
            await asyncio.wait_for(changed.wait(), 30)

    core = EngineCore(EngineConfig(model="tiny", max_num_seqs=8), runner, "engine-t", publish)
    assert core.load()["kv_release_s"] == [] and core.load()["decode_step_s"] == 0  # no step timed yet
    loop = asyncio.create_task(core.run())
    try:
        for request_id, max_tokens in (("long", 200), ("short", 60)):
            assert core.submit(task(runner, request_id, max_tokens)).accepted
        await until(lambda: tokens.get("long", 0) >= 5 and tokens.get("short", 0) >= 5)
        load = core.load()  # between two steps: the loop awaits the model
        step_s = 1 / core.step_rate.value
        assert step_s > 0 and load["decode_step_s"] == step_s  # the router prices a burst's stays with it
        # nothing was loaded: every prompt token was computed, so both prefill rates are the compute's
        rates = core.prefill_rates
        assert load["rates"] == {PROMPT_RATE: rates.prompt.value, COMPUTE_RATE: rates.compute.value}
        assert load["rates"][COMPUTE_RATE] == load["rates"][PROMPT_RATE] > 0
        done = {s.request_id: len(s.output_token_ids) for s in core.seqs.values()}
        blocks = {s.request_id: len(s.block_ids) for s in core.seqs.values()}
        assert load["kv_release_s"] == pytest.approx(
            [(60 - done["short"]) * step_s, (200 - done["long"]) * step_s]
        )
        assert load["kv_release_tokens"] == [blocks["short"] * BLOCK, blocks["long"] * BLOCK]
        report = LoadReport(
            service_id="engine-t", role="colocated", node=0, seq=1, sent_at=time.time(), **load
        )
        assert decode(encode(report), LoadReport) == report  # what the engine sends passes admission
        await until(lambda: "short" not in core.seqs)
        assert len(core.load()["kv_release_tokens"]) == 1  # the finished request gave its KV back
    finally:
        loop.cancel()
        await core.close()


def test_a_step_that_loaded_a_stored_prefix_counts_in_the_prompt_rate_only(runner: ModelRunner) -> None:
    """The compute rate is what a cost model built from measured rates prices new tokens at: a step that
    computed 100 tokens over 1,800 it loaded in 20 ms made 95,000 prompt tokens a second ready, but says
    nothing of how fast 1,900 would compute."""

    async def publish(router_id: str, batch: TokenBatch) -> None:
        return None

    core = EngineCore(EngineConfig(model="tiny"), runner, "engine-r", publish)
    core.prefill_rates.count(100, 1800, 0.02)
    assert core.load()["rates"] == {PROMPT_RATE: pytest.approx(95_000), COMPUTE_RATE: 0.0}
    core.prefill_rates.count(500, 0, 0.1)
    rates = core.load()["rates"]
    assert rates[COMPUTE_RATE] == pytest.approx(5_000) and 5_000 < rates[PROMPT_RATE] < 95_000


def seq(max_tokens: int, generated: int, block_ids: list[int]) -> Any:
    """What `release_schedule` reads of a sequence."""
    return SimpleNamespace(
        sampling=SamplingParams(max_tokens=max_tokens), output_token_ids=[0] * generated, block_ids=block_ids
    )


def test_the_schedule_groups_by_steps_left_skips_placeholders_and_keeps_the_soonest() -> None:
    running = [seq(10, 4, [1, 2]), seq(8, 2, [3]), seq(5, 1, [-7, -7, 4])]  # -7: a routed chunk's placeholder
    schedule = release_schedule(running, block_size=16, null_block=-7, step_s=0.01)
    assert schedule["kv_release_s"] == pytest.approx([0.04, 0.06])  # 4 steps left; 6 steps left (two)
    assert schedule["kv_release_tokens"] == [16, 48]
    past = [seq(3, 3, [1])]  # at its limit (its last token pending): one step
    assert release_schedule(past, block_size=16, null_block=-1, step_s=0.01)["kv_release_s"] == [0.01]
    many = [seq(100 + i, 0, [i]) for i in range(MAX_RELEASES + 5)]
    assert (
        len(release_schedule(many, block_size=16, null_block=-1, step_s=0.01)["kv_release_s"]) == MAX_RELEASES
    )
    assert release_schedule(running, block_size=16, null_block=-7, step_s=0.0)["kv_release_s"] == []


async def test_the_warm_up_prefill_gives_the_first_report_a_rate_and_keeps_no_kv(runner: ModelRunner) -> None:
    """Routers size admission by the reported prefill rate (DualPath's beta); before any request, an engine
    that ran its warm-up reports a measured one, and the warm-up's KV blocks are all free again."""

    async def publish(router_id: str, batch: TokenBatch) -> None:
        return None

    core = EngineCore(EngineConfig(model="tiny"), runner, "engine-w", publish)
    free = runner.kv.num_free_blocks
    assert core.load()["rates"] == {PROMPT_RATE: 0.0, COMPUTE_RATE: 0.0}  # nothing measured yet
    assert await seed_prefill_rates(runner, core.prefill_rates, 0) == 0.0  # off: still nothing
    assert core.load()["rates"][PROMPT_RATE] == 0.0
    rate = await seed_prefill_rates(runner, core.prefill_rates, 4 * BLOCK + 3)
    assert rate > 0 and core.load()["rates"] == {PROMPT_RATE: rate, COMPUTE_RATE: rate}
    assert runner.kv.num_free_blocks == free
    # one that does not fit the cache does not run (and takes nothing)
    assert await seed_prefill_rates(runner, core.prefill_rates, (free + 1) * BLOCK) == 0.0
    assert runner.kv.num_free_blocks == free and core.load()["rates"][PROMPT_RATE] == rate


@pytest.mark.parametrize("order", ["short-first", "fcfs"])
async def test_a_short_first_engine_reports_the_tokens_left_of_its_prefills(
    runner: ModelRunner, order: str
) -> None:
    """The router places a warm turn on a busy PE when the work that PE runs before it is short: the report
    lists each prefill's tokens left, fewest first (a FCFS engine's order says nothing of the sort)."""

    async def publish(router_id: str, batch: TokenBatch) -> None:
        return None

    core = EngineCore(EngineConfig(model="tiny", prefill_order=order), runner, "engine-q", publish)
    try:
        long = task(runner, "long", 4)  # PROMPT: 53 tokens
        short = task(runner, "short", 4)
        short.plan.prompt_token_ids = PROMPT[:20]
        short.plan.kv = KvPlan(block_hashes=block_hashes(PROMPT[:20], BLOCK, runner.fingerprint))
        for t in (long, short):
            assert core.submit(t).accepted
        if order == "short-first":  # still loading their (empty) stored prefix: listed all the same
            assert {s.status for s in core.seqs.values()} == {SeqStatus.PREPARING}
            assert core.load()["prefill_left_tokens"] == [20, len(PROMPT)]
        await asyncio.wait_for(
            asyncio.gather(*(s.prepare_task for s in core.seqs.values() if s.prepare_task)), 30
        )
        load = core.load()  # both wait: the step loop is not running
        assert load["prefill_order"] == order
        if order == "fcfs":
            assert "prefill_left_tokens" not in load
        else:
            assert load["prefill_left_tokens"] == [20, len(PROMPT)] and load["num_prefills"] == 2
        report = LoadReport(service_id="engine-q", role="prefill", node=0, seq=1, sent_at=time.time(), **load)
        assert decode(encode(report), LoadReport) == report
    finally:
        await core.close()


def test_a_step_target_sizes_the_budget_from_the_measured_compute_rate(runner: ModelRunner) -> None:
    """`--step-target-s`: each step's prefill budget is the tokens the measured compute rate runs in the
    target (the warm-up gives the first rate), within 64 and max_num_batched_tokens, on the plain budget and
    on a prefill engine's compute-quota planner; the load report says the budget in force."""

    async def publish(router_id: str, batch: TokenBatch) -> None:
        return None

    assert step_budget(300.0, 1.0, 2048) == 300
    assert step_budget(0.0, 1.0, 2048) == 2048 and step_budget(300.0, 0.0, 2048) == 2048  # unmeasured; off
    assert step_budget(10.0, 1.0, 2048) == 64 and step_budget(1e6, 1.0, 2048) == 2048
    assert step_budget(10.0, 1.0, 32) == 32
    fixed = EngineCore(EngineConfig(model="tiny"), runner, "engine-f", publish)
    assert fixed.scheduler.step_budget is None
    for role in ("colocated", "prefill"):
        config = EngineConfig(model="tiny", role=role, step_target_s=0.05, max_num_batched_tokens=4096)
        core = EngineCore(config, runner, f"engine-{role}", publish)
        assert core.scheduler.schedule().is_empty and core.scheduler.max_num_batched_tokens == 4096
        core.prefill_rates.count(3000, 0, 1.0)  # 3,000 tokens/s measured
        core.scheduler.schedule()
        assert core.scheduler.max_num_batched_tokens == 150
        if role == "prefill":
            assert core.quota is not None and core.quota.limits.max_num_batched_tokens == 150

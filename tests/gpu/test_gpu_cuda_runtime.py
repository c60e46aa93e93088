"""The model runtime on CUDA: agreement with the CPU, layerwise prefill with host<->device KV copies,
batched decode, byte-exact export/import. Skipped without a CUDA device."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

from gpu.runner import DecodeSeq, LayerHook, ModelRunner, PrefillSeq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MODELS = ["tiny", "tiny-mla"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def load(name: str, cache_dir: str, device: str, dtype: str) -> ModelRunner:
    return ModelRunner.load(name, device=device, dtype=dtype, cache_dir=cache_dir, num_kv_blocks=32)


@pytest.fixture(params=MODELS)
def cuda_runner(request: pytest.FixtureRequest, cache_dir: str) -> Iterator[ModelRunner]:
    runner = load(request.param, cache_dir, "cuda", "float32")
    yield runner
    runner.close()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 29 + salt * 5 + 1) % 256 for i in range(n)]


async def prefill_all(runner: ModelRunner, ids: list[int], hook: LayerHook | None = None) -> torch.Tensor:
    blocks = runner.kv.allocate(-(-len(ids) // runner.block_size))
    try:
        return await runner.prefill_logits([PrefillSeq("s", blocks, 0, ids)], hook, all_tokens=True)
    finally:
        runner.kv.free(blocks)


@pytest.mark.parametrize("name", MODELS)
async def test_cuda_matches_cpu(name: str, cache_dir: str) -> None:
    ids = prompt(150)
    cpu = load(name, cache_dir, "cpu", "float32")
    try:
        reference = await prefill_all(cpu, ids)
    finally:
        cpu.close()
    for dtype in ("float32", "bfloat16"):
        runner = load(name, cache_dir, "cuda", dtype)
        try:
            logits = await prefill_all(runner, ids)
        finally:
            runner.close()
        assert logits.device.type == "cpu" and logits.dtype == torch.float32
        error = (logits - reference).abs()
        if dtype == "float32":
            assert error.max().item() < 1e-3
        else:  # bf16 keeps ~3 digits: judge the distribution, not the worst logit (MoE routing may flip)
            assert error.mean().item() < 0.05
            assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.9


def _full_blocks(runner: ModelRunner, block_ids: list[int]) -> np.ndarray:
    kv = runner.kv
    out = np.empty((len(block_ids), kv.num_layers, kv.block_size, kv.bytes_per_token_layer), dtype=np.uint8)
    kv.export_blocks(block_ids, out)
    return out


class Supply(LayerHook):
    def __init__(self, runner: ModelRunner, block_ids: list[int], staged: np.ndarray) -> None:
        self.runner, self.block_ids, self.staged = runner, block_ids, staged
        self.exported: list[np.ndarray] = []

    async def before_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        self.runner.kv.import_layer(self.block_ids, layer, self.staged[:, layer])

    async def after_layer(self, layer: int, seqs: Sequence[PrefillSeq]) -> None:
        out = np.empty(
            (len(seqs[0].block_ids), self.runner.block_size, self.runner.kv.bytes_per_token_layer),
            dtype=np.uint8,
        )
        self.runner.kv.export_layer(seqs[0].block_ids, layer, out)
        self.exported.append(out)


async def test_cuda_layerwise_prefill_with_host_kv(cuda_runner: ModelRunner) -> None:
    runner, bs = cuda_runner, cuda_runner.block_size
    ids = prompt(100, salt=2)
    ref_blocks = runner.kv.allocate(2)
    reference = await runner.prefill_logits([PrefillSeq("r", ref_blocks, 0, ids)], all_tokens=True)
    staged = _full_blocks(runner, ref_blocks[:1])
    blocks = runner.kv.allocate(2)
    runner.kv.import_blocks(blocks, np.zeros_like(_full_blocks(runner, blocks)))
    hook = Supply(runner, blocks[:1], staged)
    logits = await runner.prefill_logits([PrefillSeq("h", blocks, bs, ids[bs:])], hook, all_tokens=True)
    assert (logits - reference[bs:]).abs().max().item() < 1e-3
    assert len(hook.exported) == runner.spec.num_layers
    assert hook.exported[0][0].tobytes() == staged[0, 0].tobytes()  # the supplied hit rows, then new rows
    runner.kv.free(ref_blocks + blocks)


async def test_cuda_batched_decode_equals_single(cuda_runner: ModelRunner) -> None:
    runner = cuda_runner
    lengths = [3, 66, 130]
    seqs = [PrefillSeq(f"d{i}", runner.kv.allocate(3), 0, prompt(n, i)) for i, n in enumerate(lengths)]
    first = await runner.prefill(seqs)
    steps = [
        DecodeSeq(s.seq_id, s.block_ids, n, int(t or 0)) for s, n, t in zip(seqs, lengths, first, strict=True)
    ]
    batched = await runner.decode_logits(steps)
    alone = torch.cat([await runner.decode_logits([s]) for s in steps])
    assert (batched - alone).abs().max().item() < 1e-3
    for seq in seqs:
        runner.kv.free(seq.block_ids)


async def test_cuda_export_import_is_byte_exact(cache_dir: str) -> None:
    runner = load("tiny", cache_dir, "cuda", "bfloat16")
    try:
        kv = runner.kv
        shape = (4, kv.num_layers, kv.block_size, kv.bytes_per_token_layer)
        data = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
        ids = [9, 3, 4, 5]
        kv.import_blocks(ids, data)
        out = np.empty_like(data)
        kv.export_blocks(ids, out)
        assert out.tobytes() == data.tobytes()
        layer = np.empty_like(data[:, 2])
        kv.export_layer(ids, 2, layer)
        assert layer.tobytes() == np.ascontiguousarray(data[:, 2]).tobytes()
    finally:
        runner.close()

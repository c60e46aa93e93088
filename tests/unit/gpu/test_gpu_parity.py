"""Logits parity with transformers (fp32, within 1e-4) for random Llama, Qwen2 and DeepSeek-V2 checkpoints.

Each case builds a random transformers model, saves it with save_pretrained, loads the folder with our
loader and compares every prompt position's logits, then a few decode steps against a full forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu.layers import DenseMlp
from gpu.runner import DecodeSeq, ModelRunner, PrefillSeq

TOLERANCE = 1e-4


def _llama(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    base: dict[str, Any] = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    return LlamaConfig(**{**base, **overrides})


def _qwen2(**overrides: Any) -> Any:
    from transformers import Qwen2Config

    base: dict[str, Any] = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    return Qwen2Config(**{**base, **overrides})


def _deepseek_v2(**overrides: Any) -> Any:
    from transformers import DeepseekV2Config

    base: dict[str, Any] = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        max_position_embeddings=512,
    )
    return DeepseekV2Config(**{**base, **overrides})


CASES: dict[str, Callable[[], Any]] = {
    "llama": lambda: _llama(),
    "llama-biases-tied-linear-rope": lambda: _llama(
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "llama3-rope": lambda: _llama(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    ),
    "qwen2": lambda: _qwen2(),
    "deepseek-v2": lambda: _deepseek_v2(),
    "deepseek-v2-q-lora-yarn-grouped": lambda: _deepseek_v2(
        q_lora_rank=24,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "rope_theta": 10000.0,
        },
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
    ),
}


def _hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_prefill_and_decode_logits_match_transformers(
    case: str, hf_checkpoint: Callable[..., tuple[Path, Any]]
) -> None:
    folder, model = hf_checkpoint(CASES[case](), seed=len(case))
    runner = ModelRunner.load(str(folder), num_kv_blocks=16, block_size=16)
    try:
        ids = [(i * 37 + 11) % 97 for i in range(150)]  # past the yarn/llama3 original context
        blocks = runner.kv.allocate(11)
        ours = await runner.prefill_logits([PrefillSeq("s", blocks, 0, ids)], all_tokens=True)
        reference = _hf_logits(model, ids)
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max().item() < TOLERANCE
        context = list(ids)
        for token in (5, 60, 96):  # decode steps (MLA: the absorbed path) against full forwards
            step = await runner.decode_logits([DecodeSeq("s", blocks, len(context), token)])
            context.append(token)
            assert (step[0] - _hf_logits(model, context)[-1]).abs().max().item() < TOLERANCE
    finally:
        runner.close()


async def test_sharded_checkpoint_loads(hf_checkpoint: Callable[..., tuple[Path, Any]]) -> None:
    folder, model = hf_checkpoint(_qwen2(), seed=3, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    runner = ModelRunner.load(str(folder), num_kv_blocks=4, block_size=16)
    try:
        ids = list(range(1, 30))
        ours = await runner.prefill_logits([PrefillSeq("s", runner.kv.allocate(2), 0, ids)], all_tokens=True)
        assert (ours - _hf_logits(model, ids)).abs().max().item() < TOLERANCE
    finally:
        runner.close()


async def test_embedded_models_match_transformers(runner: ModelRunner) -> None:
    """The embedded folders are ordinary HF checkpoints: transformers loads them and agrees with us."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runner.spec.model_dir).eval()
    ids = runner.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    blocks = runner.kv.allocate(3)
    try:
        ours = await runner.prefill_logits([PrefillSeq("s", blocks, 0, ids)], all_tokens=True)
        assert (ours - _hf_logits(model, ids)).abs().max().item() < TOLERANCE
    finally:
        runner.kv.free(blocks)


async def test_plain_and_onednn_linear_agree(model_cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU fast path (oneDNN-packed weights) and plain F.linear give the same model."""
    from gpu import linear

    ids = list(range(3, 70))
    logits = []
    for use_onednn in (True, False):
        monkeypatch.setattr(linear, "USE_ONEDNN", use_onednn)
        runner = ModelRunner.load("tiny-mla", cache_dir=model_cache, num_kv_blocks=4)
        try:
            dense_mlp = runner.model.layers[0].mlp
            assert isinstance(dense_mlp, DenseMlp)
            packed = dense_mlp.gate_up.packed
            assert (packed is not None) == (use_onednn and linear._onednn_available())
            blocks = runner.kv.allocate(2)
            logits.append(await runner.prefill_logits([PrefillSeq("s", blocks, 0, ids)], all_tokens=True))
        finally:
            runner.close()
    assert (logits[0] - logits[1]).abs().max().item() < 1e-5

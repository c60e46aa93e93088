"""Fixtures of the model-runtime tests: isolated model cache, loaded tiny runners, random HF checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu import byte_tokenizer
from gpu.runner import ModelRunner


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Embedded models are written here once per test session (never into ~/.cache)."""
    return str(tmp_path_factory.mktemp("models"))


def _runner(name: str, cache: str) -> Iterator[ModelRunner]:
    runner = ModelRunner.load(name, cache_dir=cache, num_kv_blocks=96)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def tiny_runner(model_cache: str) -> Iterator[ModelRunner]:
    yield from _runner("tiny", model_cache)


@pytest.fixture(scope="module")
def mla_runner(model_cache: str) -> Iterator[ModelRunner]:
    yield from _runner("tiny-mla", model_cache)


@pytest.fixture(params=["tiny", "tiny-mla"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    """Both embedded models: GQA and MLA."""
    fixture = "tiny_runner" if request.param == "tiny" else "mla_runner"
    return request.getfixturevalue(fixture)  # type: ignore[no-any-return]


def reinit_weights(model: Any, seed: int) -> None:
    """Weights with unit-scale activations (HF's 0.02 init makes attention nearly uniform, hiding bugs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1 and "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif param.dim() == 1:
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    """Build a random transformers model from a config, save it as an HF folder; (folder, model)."""

    def build(config: Any, *, seed: int = 0, max_shard_size: str | None = None) -> tuple[Path, Any]:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        reinit_weights(model, seed)
        folder = tmp_path / f"ckpt-{config.model_type}-{seed}"
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(folder, **kwargs)
        (folder / "tokenizer.json").write_text(
            byte_tokenizer.tokenizer_json()
        )  # every servable folder has one
        return folder, model

    return build

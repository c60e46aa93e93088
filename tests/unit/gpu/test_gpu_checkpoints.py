"""Corrupt or mismatched checkpoints fail naming the tensor (or file); other valid layouts load."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from gpu.errors import CheckpointError
from gpu.model_spec import resolve_model
from gpu.runner import ModelRunner, PrefillSeq

Edit = Callable[[dict[str, np.ndarray]], None]


def copy_model(model_cache: str, name: str, dest: Path, edit: Edit | None = None) -> Path:
    shutil.copytree(resolve_model(name, model_cache), dest)
    if edit is not None:
        tensors = load_file(str(dest / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def load(folder: Path) -> ModelRunner:
    return ModelRunner.load(str(folder), num_kv_blocks=4)


def test_missing_tensor_is_named(model_cache: str, tmp_path: Path) -> None:
    folder = copy_model(
        model_cache, "tiny", tmp_path / "m", lambda t: t.pop("model.layers.2.self_attn.k_proj.weight")
    )
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.self_attn\.k_proj\.weight"):
        load(folder)


def test_misshaped_tensor_is_named(model_cache: str, tmp_path: Path) -> None:
    def shrink(tensors: dict[str, np.ndarray]) -> None:
        tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][
            :, :700
        ]

    with pytest.raises(
        CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight has shape \[256, 700\]"
    ):
        load(copy_model(model_cache, "tiny", tmp_path / "m", shrink))


def test_config_that_does_not_match_the_weights(model_cache: str, tmp_path: Path) -> None:
    folder = copy_model(model_cache, "tiny-mla", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["kv_lora_rank"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight"):
        load(folder)


def test_corrupt_file_and_values(model_cache: str, tmp_path: Path) -> None:
    folder = copy_model(model_cache, "tiny", tmp_path / "truncated")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(folder)

    def poison(tensors: dict[str, np.ndarray]) -> None:
        tensors["model.layers.3.self_attn.o_proj.weight"][5, 7] = np.nan

    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.o_proj\.weight contains NaN"):
        load(copy_model(model_cache, "tiny", tmp_path / "nan", poison))


def test_sharded_index_with_a_missing_shard(model_cache: str, tmp_path: Path) -> None:
    folder = copy_model(model_cache, "tiny", tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file({n: tensors[n] for n in first}, str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    with pytest.raises(
        CheckpointError, match=rf"model-00002-of-00002\.safetensors \(holding tensor {second[0]}"
    ):
        load(folder)


def test_no_weights_at_all(model_cache: str, tmp_path: Path) -> None:
    folder = copy_model(model_cache, "tiny", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load(folder)


async def test_fused_expert_layout_loads_the_same_model(model_cache: str, tmp_path: Path) -> None:
    """transformers 5 keeps routed experts fused ([E, 2I, H] / [E, H, I]); both layouts give one model."""

    def fuse(tensors: dict[str, np.ndarray]) -> None:
        for layer in range(1, 4):
            prefix = f"model.layers.{layer}.mlp.experts."
            gate_up, down = [], []
            for e in range(8):
                gate = tensors.pop(f"{prefix}{e}.gate_proj.weight")
                up = tensors.pop(f"{prefix}{e}.up_proj.weight")
                gate_up.append(np.concatenate([gate, up]))
                down.append(tensors.pop(f"{prefix}{e}.down_proj.weight"))
            tensors[prefix + "gate_up_proj"] = np.stack(gate_up)
            tensors[prefix + "down_proj"] = np.stack(down)

    fused = load(copy_model(model_cache, "tiny-mla", tmp_path / "fused", fuse))
    plain = load(Path(resolve_model("tiny-mla", model_cache)))
    try:
        ids = list(range(40))
        logits = [
            await r.prefill_logits([PrefillSeq("s", r.kv.allocate(1), 0, ids)], all_tokens=True)
            for r in (fused, plain)
        ]
        assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0)
    finally:
        fused.close()
        plain.close()

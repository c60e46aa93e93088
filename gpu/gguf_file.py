"""GGUF files (llama.cpp's single-file format): metadata -> `ArchConfig`, tokenizer parts. No torch.

The `gguf` package (from llama.cpp) parses the file and memory-maps its tensors (read through a plain ndarray
view of the map: `_plain_reader`). The architecture's metadata is rewritten as the config.json transformers
would have, so one parser (`gpu.arch_config`) checks both formats. A file that is not GGUF, is cut short, or
names an architecture or quantization this runtime does not read fails with one `CheckpointError` /
`UnsupportedModelError` naming the file.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpu.arch_config import ArchConfig, parse_arch_config
from gpu.errors import CheckpointError, UnsupportedModelError

GGUF_SUFFIX = ".gguf"
# general.architecture -> the transformers architecture with the same tensors
ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(GGUF_SUFFIX)


@dataclass(frozen=True, slots=True)
class TokenizerParts:
    """What a GGUF file says about its tokenizer (llama.cpp's `tokenizer.ggml.*` and `tokenizer.*` keys)."""

    model: str  # "gpt2" (byte-level BPE) | "llama" (SentencePiece) | ...
    pre: str  # pre-tokenizer name ("smollm", "qwen2", "llama-bpe", ...; "default" when absent)
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    scores: list[float]  # SentencePiece piece scores (empty for BPE)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # eos, then end-of-turn / end-of-message when the file names them
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


class GgufFile:
    """One opened GGUF file: its metadata as Python values and its tensors (memory-mapped, not read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = _plain_reader()(str(path))
        except Exception as exc:  # the reader raises ValueError, IndexError, OSError... on damaged files
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._check_tensor_bounds()

    def _check_tensor_bounds(self) -> None:
        size = os.path.getsize(self.path)
        for tensor in self.reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size or tensor.data.nbytes != int(tensor.n_bytes):
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {tensor.name} ends at byte {end} of a {size}-byte file"
                )

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise CheckpointError(f"{self.path}: metadata {key} is unreadable ({exc})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata key {key} is missing", param=key)
        return value

    @property
    def architecture(self) -> str:
        arch = str(self.require("general.architecture"))
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}",
                param="general.architecture",
            )
        return arch


@functools.cache
def _plain_reader() -> type:
    """`gguf.GGUFReader` reading through a plain ndarray view of its `np.memmap`.

    The reader slices its memory map once per value, ~1.2M times for a 49k-token vocabulary, and every slice
    of an `np.memmap` runs the subclass's Python `__getitem__` and `__array_finalize__`: 2.8-3.5 s of a
    SmolLM2 file's parse. A view as `np.ndarray` reads the same mapped bytes with C-level slicing: 1.0-1.2 s,
    the same fields and tensors (tests/unit/gpu/test_gpu_gguf.py). The reader only assigns and slices
    `self.data`, so the subclass changes nothing else."""
    from gguf import GGUFReader

    class PlainReader(GGUFReader):  # type: ignore[misc]
        @property
        def data(self) -> np.ndarray:
            return self._plain  # type: ignore[no-any-return]

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)  # keeps the map alive as its base

    return PlainReader


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GgufFile:
    return GgufFile(Path(path))


def open_gguf(path: str | Path) -> GgufFile:
    """The parsed file (parsing costs about 1 s for a 49k-token vocabulary: the router and an engine each
    read the metadata and the tokenizer of one file, so both reuse one parse)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    return _open_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def hf_config(gguf: GgufFile) -> dict[str, Any]:
    """The metadata as a transformers config.json."""
    arch = gguf.architecture
    key = functools.partial(_key, gguf, arch)
    heads = key("attention.head_count")
    kv_heads = gguf.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedModelError(f"{gguf.path}: per-layer head_count_kv is not supported")
    hidden = key("embedding_length")
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": gguf.get(f"{arch}.vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": gguf.get(f"{arch}.attention.key_length", hidden // max(int(heads), 1)),
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(_eos_ids(gguf)),
        "rope_parameters": _rope(gguf, arch),
    }
    return config


def _key(gguf: GgufFile, arch: str, name: str) -> Any:
    return gguf.require(f"{arch}.{name}")


def _rope(gguf: GgufFile, arch: str) -> dict[str, Any]:
    if "rope_freqs.weight" in gguf.tensors:
        raise UnsupportedModelError(f"{gguf.path}: per-frequency RoPE factors (rope_freqs) are not supported")
    rope: dict[str, Any] = {
        "rope_theta": float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_type": "default",
    }
    scaling = gguf.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope["rope_type"] = scaling
        rope["factor"] = float(gguf.require(f"{arch}.rope.scaling.factor"))
        original = gguf.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    elif scaling != "none":
        raise UnsupportedModelError(f"{gguf.path}: rope scaling {scaling!r} is not supported")
    dim = gguf.get(f"{arch}.rope.dimension_count")
    head_dim = gguf.get(f"{arch}.attention.key_length")
    if dim is not None and head_dim is not None and dim != head_dim:
        raise UnsupportedModelError(f"{gguf.path}: partial rotary embeddings are not supported")
    return rope


def _eos_ids(gguf: GgufFile) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = gguf.get(f"tokenizer.ggml.{name}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def load_gguf_arch_config(path: str | Path) -> ArchConfig:
    gguf = open_gguf(path)
    return parse_arch_config(hf_config(gguf), {}, source=str(gguf.path))


def tokenizer_parts(path: str | Path) -> TokenizerParts:
    gguf = open_gguf(path)
    model = str(gguf.require("tokenizer.ggml.model"))
    tokens = gguf.require("tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{gguf.path}: {len(tokens)} tokens but {len(types)} token types")

    def token_id(name: str) -> int | None:
        value = gguf.get(f"tokenizer.ggml.{name}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    return TokenizerParts(
        model=model,
        pre=str(gguf.get("tokenizer.ggml.pre", "default")),
        tokens=list(tokens),
        token_types=[int(t) for t in types],
        merges=list(gguf.get("tokenizer.ggml.merges") or []),
        scores=[float(x) for x in gguf.get("tokenizer.ggml.scores") or []] if model == "llama" else [],
        bos_token_id=token_id("bos_token_id"),
        eos_token_ids=tuple(t for t in _eos_ids(gguf) if 0 <= t < len(tokens)),
        unk_token_id=token_id("unknown_token_id"),
        pad_token_id=token_id("padding_token_id"),
        add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", model == "llama")),
        chat_template=gguf.get("tokenizer.chat_template"),
    )

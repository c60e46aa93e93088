"""The score chunk of `attend`: sized to the CPU's L2 cache (read from sysfs), and exact whatever its size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpu.partial_attention as pa


def write_cache(root: Path, index: int, level: int, kind: str, size: str) -> None:
    d = root / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")


def test_the_l2_size_is_read_from_sysfs_and_defaults_when_it_says_nothing(tmp_path: Path) -> None:
    write_cache(tmp_path / "a", 0, 1, "Data", "32K")
    write_cache(tmp_path / "a", 1, 1, "Instruction", "32K")
    write_cache(tmp_path / "a", 2, 2, "Unified", "1024K")
    write_cache(tmp_path / "a", 3, 3, "Unified", "32768K")
    assert pa.l2_cache_bytes(tmp_path / "a") == 1 << 20
    write_cache(tmp_path / "b", 0, 2, "Unified", "2M")
    assert pa.l2_cache_bytes(tmp_path / "b") == 2 << 20
    write_cache(tmp_path / "c", 0, 2, "Unified", "big")  # unreadable size
    assert pa.l2_cache_bytes(tmp_path / "c") == pa.DEFAULT_L2_BYTES
    assert pa.l2_cache_bytes(tmp_path / "missing") == pa.DEFAULT_L2_BYTES


def test_a_cpu_chunk_fills_the_l2_cache_and_a_gpu_chunk_keeps_the_fixed_bound() -> None:
    assert pa.score_elements(torch.device("cpu")) == max(1 << 14, pa.l2_cache_bytes() // 4)
    assert pa.score_elements(torch.device("meta")) == pa.SCORE_ELEMENTS


@pytest.mark.parametrize("causal", [False, True])
def test_any_chunk_size_gives_the_same_partial(monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    torch.manual_seed(0)
    query, keys, values = torch.randn(37, 8, 16), torch.randn(300, 2, 16), torch.randn(300, 2, 12)
    positions = {}
    if causal:
        positions = {"query_positions": torch.arange(263, 300), "key_positions": torch.arange(300)}
    whole = pa.attend(query, keys, values, 0.25, **positions)
    for elements in (1, 8 * 300 * 5, 8 * 300 * 36):  # one row, 5 rows and 36 rows per chunk
        monkeypatch.setattr(pa, "score_elements", lambda device, n=elements: n)
        part = pa.attend(query, keys, values, 0.25, **positions)
        for a, b in ((whole.o, part.o), (whole.m, part.m), (whole.l, part.l)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

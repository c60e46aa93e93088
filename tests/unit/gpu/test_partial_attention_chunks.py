"""The two ways `attend` computes a partial: row chunks of scores (GPU; m = the max logit) and torch's fused
CPU kernel (m = the log-sum-exp, l = 1). Both are exact whatever the chunk or mask block, and they merge."""

from __future__ import annotations

import pytest
import torch

import gpu.partial_attention as pa

# heads, groups, dk, dv
SHAPES = {"gqa": (8, 2, 16, 12), "mla": (16, 1, 72, 64), "wide-values": (4, 4, 8, 24)}
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
KERNELS = 2e-6  # two kernels' fp32 round-off, relative to the largest output (1.05e-6 seen on torch 2.11)


def inputs(shape: str, num_rows: int = 37, num_keys: int = 300) -> Inputs:
    heads, groups, dk, dv = SHAPES[shape]
    gen = torch.Generator().manual_seed(len(shape))
    return (
        torch.randn(num_rows, heads, dk, generator=gen),
        torch.randn(num_keys, groups, dk, generator=gen),
        torch.randn(num_keys, groups, dv, generator=gen),
    )


def causal(num_rows: int = 37, num_keys: int = 300) -> dict[str, torch.Tensor]:
    return {
        "query_positions": torch.arange(num_keys - num_rows, num_keys),
        "key_positions": torch.arange(num_keys),
    }


def same_attention(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= KERNELS * float(want.abs().max())


def test_a_cpu_partial_comes_from_the_fused_kernel_and_a_chunked_one_from_the_max_logit() -> None:
    query, keys, values = inputs("gqa")
    fused = pa.attend(query, keys, values, 0.25)
    torch.testing.assert_close(fused.l, torch.ones_like(fused.l))  # normalised output at the log-sum-exp
    chunked = pa._attend_chunked(query, keys, values, 0.25, None)
    scores = torch.einsum("thd,shd->ths", query, keys.repeat_interleave(4, dim=1)) * 0.25
    torch.testing.assert_close(chunked.m, scores.amax(-1))
    torch.testing.assert_close(fused.m, scores.logsumexp(-1))


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_and_chunked_partials_are_the_same_attention_and_merge(shape: str, masked: bool) -> None:
    query, keys, values = inputs(shape)
    positions = causal() if masked else {}
    fused = pa.attend(query, keys, values, 0.25, **positions)
    visible = None
    if masked:
        visible = positions["key_positions"][None, :] <= positions["query_positions"][:, None]
    chunked = pa._attend_chunked(query, keys, values, 0.25, visible)
    assert same_attention(pa.finalize(fused), pa.finalize(chunked))
    cut = 150  # a chunked holder's partial over the first keys, a fused requester's over the rest
    split_pos = {k: v[cut:] if k == "key_positions" else v for k, v in positions.items()}
    head = None if visible is None else visible[:, :cut]
    first = pa._attend_chunked(query, keys[:cut], values[:cut], 0.25, head)
    rest = pa.attend(query, keys[cut:], values[cut:], 0.25, **split_pos)
    merged = pa.finalize(pa.merge([first, rest]))
    assert same_attention(merged, pa.finalize(chunked))


@pytest.mark.parametrize("causal_mask", [False, True])
def test_any_chunk_size_gives_the_same_partial(monkeypatch: pytest.MonkeyPatch, causal_mask: bool) -> None:
    query, keys, values = inputs("gqa")
    visible = torch.arange(300)[None, :] <= torch.arange(263, 300)[:, None] if causal_mask else None
    whole = pa._attend_chunked(query, keys, values, 0.25, visible)
    for elements in (1, 8 * 300 * 5, 8 * 300 * 36):  # one row, 5 rows and 36 rows per chunk
        monkeypatch.setattr(pa, "SCORE_ELEMENTS", elements)
        part = pa._attend_chunked(query, keys, values, 0.25, visible)
        for a, b in ((whole.o, part.o), (whole.m, part.m), (whole.l, part.l)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_any_mask_block_gives_the_same_partial_and_a_row_that_sees_no_key_is_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    query, keys, values = inputs("gqa", num_rows=6, num_keys=40)
    positions = {"query_positions": torch.tensor([-1, 3, 39, -5, 20, 0]), "key_positions": torch.arange(40)}
    whole = pa.attend(query, keys, values, 0.25, **positions)
    for elements in (1, 4 * 40 * 4):  # one row per block, four rows per block
        monkeypatch.setattr(pa, "MASK_ELEMENTS", elements)
        part = pa.attend(query, keys, values, 0.25, **positions)
        for a, b in ((whole.o, part.o), (whole.m, part.m), (whole.l, part.l)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for row in (0, 3):  # positions before every key: the merge's identity, not the kernel's lse = 0
        assert torch.isneginf(whole.m[row]).all() and (whole.l[row] == 0).all() and (whole.o[row] == 0).all()
    assert torch.isfinite(whole.m[[1, 2, 4, 5]]).all()
    only_first = pa.attend(query[5:], keys[:1], values[:1], 0.25)  # position 0 sees key 0 alone
    torch.testing.assert_close(pa.finalize(whole)[5], pa.finalize(only_first)[0])


def test_absorbed_mla_values_read_in_place_from_the_keys_give_the_same_partial() -> None:
    query, keys, _ = inputs("mla")
    in_place = pa.attend(query, keys, keys[..., :64], 0.25)  # a view: the kernel reads the keys as values
    copied = pa.attend(query, keys, keys[..., :64].clone(), 0.25)  # a separate tensor: zero-padded
    assert pa._leads(keys[..., :64], keys) and not pa._leads(keys[..., :64].clone(), keys)
    assert not pa._leads(keys[..., 8:], keys)
    for a, b in ((in_place.o, copied.o), (in_place.m, copied.m), (in_place.l, copied.l)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_cuda_takes_the_fused_kernel_only_for_many_unmasked_rows_of_a_width_it_runs() -> None:
    """The rule measured on an H200 (README, "Tests"): 2,048 rows x heads and up, no key hidden from any row,
    head sizes up to 1,024 in multiples of 4; everything else keeps chunked scores."""

    def pays(rows: int, heads: int, dk: int, dv: int, visible: torch.Tensor | None = None) -> bool:
        return pa._cuda_fused_pays(torch.empty(rows, heads, dk), torch.empty(8, 1, dv), visible)

    assert pays(256, 8, 128, 128) and not pays(255, 8, 128, 128)
    assert pays(128, 16, 576, 512) and not pays(64, 16, 576, 512)  # absorbed MLA
    assert not pays(4096, 8, 1028, 1028) and not pays(4096, 8, 126, 126)
    every_key = torch.ones(256, 8, dtype=torch.bool)
    some_hidden = every_key.clone()
    some_hidden[0, 7] = False
    assert pays(256, 8, 128, 128, every_key) and not pays(256, 8, 128, 128, some_hidden)
